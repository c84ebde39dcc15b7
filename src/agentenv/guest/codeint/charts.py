"""Chart data from a matplotlib figure, in the shape the E2B Code Interpreter SDKs read from a
result's `chart` (what E2B's `e2b-charts` package gives; the SDK's charts.py is the reference):

    {"type": "line"|"scatter"|"bar"|"pie"|"box_and_whisker"|"superchart"|"unknown",
     "title": str|None, "elements": [...],
     # 2D charts (line, scatter, bar, box_and_whisker):
     "x_label", "y_label", "x_unit", "y_unit": str|None,
     # line and scatter:
     "x_ticks", "y_ticks": [float|str], "x_tick_labels", "y_tick_labels": [str],
     "x_scale", "y_scale": "linear"|"datetime"|"categorical"|"log"|...}

    line/scatter elements  {"label", "points": [[x, y]...]}  (dates as ISO strings)
    bar elements           {"label", "group", "value"}
    pie elements           {"label", "angle", "radius"}
    box_and_whisker        {"label", "min", "first_quartile", "median", "third_quartile",
                            "max", "outliers": [...]}
    superchart (a figure with several axes): "elements" are the charts of its axes.

Loaded into the user's IPython kernel by pystartup.py (by path: the tools disk is not on the
kernel's sys.path) and run on every matplotlib figure it displays; it imports matplotlib and
numpy only then, as they are already imported by whoever made the figure.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

UNIT = re.compile(r"\s\((.*?)\)|\[(.*?)\]")  # "Time (s)" or "Length [m]"
SIGNIFICANT = "{:.10g}"  # rounding of what is computed from geometry (box edges)
PIE_SIGNIFICANT = "{:.6g}"  # matplotlib computes pie angles in float32


def figure_to_chart(figure: Any) -> dict[str, Any]:
    """The chart of a figure, {} for one with nothing drawn."""
    axes = list(figure.get_axes())
    if not any(ax.has_data() for ax in axes):
        return {}
    if len(axes) == 1:
        return axes_to_chart(axes[0])
    suptitle = figure.get_suptitle() if hasattr(figure, "get_suptitle") else (
        figure._suptitle.get_text() if getattr(figure, "_suptitle", None) else "")
    return {"type": "superchart", "title": suptitle or None,
            "elements": [axes_to_chart(ax) for ax in axes]}


def axes_to_chart(ax: Any) -> dict[str, Any]:
    kind = chart_type(ax)
    chart: dict[str, Any] = {"type": kind, "title": ax.get_title() or None, "elements": []}
    if kind == "pie":
        chart["elements"] = pie_elements(ax)
        return chart
    if kind == "unknown":
        return chart
    chart.update(labels_2d(ax))
    if kind in ("line", "scatter"):
        chart.update(ticks(ax, "x"))
        chart.update(ticks(ax, "y"))
        chart["elements"] = line_elements(ax) if kind == "line" else scatter_elements(ax)
    elif kind == "bar":
        horizontal, chart["elements"] = bar_elements(ax)
        if horizontal:
            swap_xy(chart)
    else:
        horizontal, chart["elements"] = box_elements(ax)
        if horizontal:
            swap_xy(chart)
    return chart


def chart_type(ax: Any) -> str:
    from matplotlib.collections import PathCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import PathPatch, Rectangle, Wedge

    drawn = [*ax.lines, *ax.collections, *ax.patches, *ax.images, *ax.tables]
    if not drawn:
        return "unknown"
    if all(isinstance(a, Line2D) for a in drawn):
        return "line"
    if all(isinstance(a, (PathPatch, Line2D)) for a in drawn) and ax.patches:
        return "box_and_whisker"
    # reference lines (axhline/axvline) do not make a scatter or bar chart something else
    marks = [a for a in drawn if not (isinstance(a, Line2D) and is_reference_line(a))]
    for kind, cls in (("scatter", PathCollection), ("pie", Wedge), ("bar", Rectangle)):
        if marks and all(isinstance(a, cls) for a in marks):
            return kind
    return "unknown"


def is_reference_line(line: Any) -> bool:
    """A straight horizontal or vertical two-point line across the axes (axhline, axvline)."""
    xs, ys = list(line.get_xdata()), list(line.get_ydata())
    return len(xs) == 2 and (xs[0] == xs[1] or ys[0] == ys[1]) and \
        line.get_transform() is not line.axes.transData


def labels_2d(ax: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for axis, label in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
        out[f"{axis}_label"] = label or None
        match = UNIT.search(label) if label else None
        out[f"{axis}_unit"] = (match.group(1) or match.group(2)) if match else None
    return out


def swap_xy(chart: dict[str, Any]) -> None:
    """Horizontal bars and boxes: x_* names the category axis, as for vertical ones."""
    chart["x_label"], chart["y_label"] = chart["y_label"], chart["x_label"]
    chart["x_unit"], chart["y_unit"] = chart["y_unit"], chart["x_unit"]


def converter_module(axis: Any) -> str:
    get = getattr(axis, "get_converter", None)
    converter = get() if get is not None else getattr(axis, "converter", None)
    return type(converter).__module__ if converter is not None else ""


def scale(ax: Any, name: str) -> str:
    axis = ax.xaxis if name == "x" else ax.yaxis
    module = converter_module(axis)
    if module == "matplotlib.dates":
        return "datetime"
    if module == "matplotlib.category":
        return "categorical"
    return str(ax.get_xscale() if name == "x" else ax.get_yscale())


def ticks(ax: Any, name: str) -> dict[str, Any]:
    axis = ax.xaxis if name == "x" else ax.yaxis
    dates = converter_module(axis) == "matplotlib.dates"
    values = [date_from_number(t) if dates else float(t) for t in axis.get_ticklocs()]
    labels = [t.get_text() for t in axis.get_ticklabels()]
    return {f"{name}_ticks": values, f"{name}_tick_labels": labels,
            f"{name}_scale": scale(ax, name)}


def date_from_number(value: float) -> str:
    from matplotlib.dates import num2date

    return str(num2date(value).isoformat())


def plain(value: Any, date_axis: bool = False) -> float | str:
    """A data value as JSON: dates as ISO strings, numbers as floats, the rest as text."""
    import numpy

    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, numpy.datetime64):
        return str(value.astype("datetime64[s]"))
    if isinstance(value, (int, float, numpy.number)) and not isinstance(value, bool):
        return date_from_number(float(value)) if date_axis else float(value)
    return str(value)


def rounded(value: float) -> float:
    return float(SIGNIFICANT.format(float(value)))


def default_label(label: str, hidden_prefix: str, shown: str) -> str:
    """matplotlib's names for unlabelled artists ("_child3", "_container1") as E2B shows them
    ("Line 3", "Group 1")."""
    if label.startswith(hidden_prefix) and label[len(hidden_prefix):].isdigit():
        return f"{shown} {label[len(hidden_prefix):]}"
    return label


def line_elements(ax: Any) -> list[dict[str, Any]]:
    return [{"label": default_label(str(line.get_label()), "_child", "Line"),
             "points": [[plain(x), plain(y)]
                        for x, y in zip(line.get_xdata(), line.get_ydata(), strict=False)]}
            for line in ax.lines if not is_reference_line(line)]


def scatter_elements(ax: Any) -> list[dict[str, Any]]:
    x_dates = converter_module(ax.xaxis) == "matplotlib.dates"
    y_dates = converter_module(ax.yaxis) == "matplotlib.dates"
    return [{"label": str(collection.get_label()),
             "points": [[plain(x, x_dates), plain(y, y_dates)]
                        for x, y in collection.get_offsets()]}
            for collection in ax.collections]


def tick_label_at(axis: Any, position: float) -> str:
    """The label of the tick nearest to a position on an axis (a bar's or box's category)."""
    locs = list(axis.get_ticklocs())
    labels = [t.get_text() for t in axis.get_ticklabels()]
    if not locs or len(locs) != len(labels):
        return str(rounded(position))
    nearest = min(range(len(locs)), key=lambda i: abs(locs[i] - position))
    return labels[nearest]


def bar_elements(ax: Any) -> tuple[bool, list[dict[str, Any]]]:
    from matplotlib.container import BarContainer

    horizontal = False
    elements = []
    for container in ax.containers:
        if not isinstance(container, BarContainer):
            continue
        group = default_label(str(container.get_label()), "_container", "Group")
        horizontal = getattr(container, "orientation", "vertical") == "horizontal"
        for rect in container:
            if horizontal:
                label = tick_label_at(ax.yaxis, rect.get_y() + rect.get_height() / 2)
                value = rect.get_width()
            else:
                label = tick_label_at(ax.xaxis, rect.get_x() + rect.get_width() / 2)
                value = rect.get_height()
            elements.append({"label": label, "group": group, "value": float(value)})
    return horizontal, elements


def pie_elements(ax: Any) -> list[dict[str, Any]]:
    def pie_rounded(value: float) -> float:
        return float(PIE_SIGNIFICANT.format(float(value)))

    return [{"label": str(wedge.get_label()), "angle": pie_rounded(wedge.theta2 - wedge.theta1),
             "radius": pie_rounded(wedge.r)} for wedge in ax.patches]


def box_elements(ax: Any) -> tuple[bool, list[dict[str, Any]]]:
    """Boxes from the box patches and the lines around them (whiskers end at min and max, the
    median crosses the box, fliers are the marker-only lines over it)."""
    boxes = []
    for patch in ax.patches:
        vertices = patch.get_path().vertices
        boxes.append((float(vertices[:, 0].min()), float(vertices[:, 0].max()),
                      float(vertices[:, 1].min()), float(vertices[:, 1].max())))
    widths = {round(x1 - x0, 9) for x0, x1, _, _ in boxes}
    heights = {round(y1 - y0, 9) for _, _, y0, y1 in boxes}
    horizontal = (len(heights) == 1 and len(widths) > 1) or (
        len(boxes) == 1 and boxes[0][3] - boxes[0][2] < boxes[0][1] - boxes[0][0])
    lines = []
    for line in ax.lines:
        xs = [float(v) for v in line.get_xdata()]
        ys = [float(v) for v in line.get_ydata()]
        if horizontal:
            xs, ys = ys, xs
        marker_only = str(line.get_linestyle()) in ("None", "", " ")
        lines.append((xs, ys, marker_only))
    elements = []
    for x0, x1, y0, y1 in boxes:
        if horizontal:
            x0, x1, y0, y1 = y0, y1, x0, x1
        low, high, outliers = y0, y1, []
        median, median_span = (y0 + y1) / 2, -1.0  # the crossing line widest across the box
        for xs, ys, marker_only in lines:
            if not xs or not all(x0 - 1e-9 <= x <= x1 + 1e-9 for x in xs):
                continue
            if marker_only:
                outliers.extend(ys)
            elif len(xs) == 2 and xs[0] == xs[1]:  # a whisker
                if min(ys) <= y0 + 1e-9 and max(ys) <= y0 + 1e-9 * max(1, abs(y0)):
                    low = min(ys)
                elif min(ys) >= y1 - 1e-9 * max(1, abs(y1)):
                    high = max(ys)
            elif len(ys) == 2 and ys[0] == ys[1] and y0 <= ys[0] <= y1 \
                    and abs(xs[1] - xs[0]) > median_span:
                median, median_span = ys[0], abs(xs[1] - xs[0])
        axis = ax.yaxis if horizontal else ax.xaxis
        elements.append({
            "label": tick_label_at(axis, (x0 + x1) / 2), "min": rounded(low),
            "first_quartile": rounded(y0), "median": rounded(median),
            "third_quartile": rounded(y1), "max": rounded(high),
            "outliers": [rounded(v) for v in outliers]})
    return horizontal, elements
