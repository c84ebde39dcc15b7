"""Run by the code-interpreter's Python kernel at its start (IPKernelApp.exec_files, in the
user's namespace, so it leaves no names there): adds the `e2b/chart` display format, the chart
data of each matplotlib figure the kernel displays (charts.py beside this file), and the
`e2b/data` one, a pandas DataFrame's columns as lists (the SDKs' `result.data`); a PIL image
saved to a file is also displayed (its png a result), as in E2B's template."""


def _aenv_setup() -> None:
    import importlib.util
    import os
    import sys

    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("_aenv_charts", os.path.join(here, "charts.py"))
    assert spec is not None and spec.loader is not None
    charts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(charts)

    class ChartFormatter(BaseFormatter):  # type: ignore[misc]
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict,)

        def __call__(self, obj: object) -> object:
            # only a figure of an already imported matplotlib (no import for other values)
            figure_module = sys.modules.get("matplotlib.figure")
            if figure_module is None or not isinstance(obj, figure_module.Figure):
                return super().__call__(obj)
            try:
                return charts.figure_to_chart(obj) or None
            except Exception:  # a figure it cannot read still displays as an image
                return None

    class DataFormatter(BaseFormatter):  # type: ignore[misc]
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

        def __call__(self, obj: object) -> object:
            # only a DataFrame of an already imported pandas (no import for other values)
            pandas = sys.modules.get("pandas")
            if pandas is None or not isinstance(obj, pandas.DataFrame):
                return super().__call__(obj)
            try:
                columns = obj.to_dict(orient="list")
                return {str(name): [v.isoformat() if isinstance(v, pandas.Timestamp) else v
                                    for v in values] for name, values in columns.items()}
            except Exception:  # a frame it cannot read still displays as a table
                return None

    shell = get_ipython()
    if shell is not None:
        formatters = shell.display_formatter.formatters
        formatters["e2b/chart"] = ChartFormatter(parent=shell.display_formatter)
        formatters["e2b/data"] = DataFormatter(parent=shell.display_formatter)

    try:  # Debian's python3-pil is in the image; a kernel without it has nothing to patch
        from PIL import Image
    except ImportError:
        return
    from IPython.display import display

    saving = Image.Image.save

    def save(self: object, fp: object, *args: object, **kwargs: object) -> object:
        if isinstance(fp, str | os.PathLike):  # a file by name (not a buffer): shown too
            display(self)
        return saving(self, fp, *args, **kwargs)

    save.__doc__ = saving.__doc__
    Image.Image.save = save  # type: ignore[method-assign]


_aenv_setup()
del _aenv_setup
