// Pages are built with DOM calls, never innerHTML: what the API returns (metadata, log lines,
// names) is shown as text and cannot become markup.
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "class") el.className = value;
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

export const link = (href, text) => h("a", { href }, text);
export const sandboxLink = (id) => (id ? link(`#/sandboxes/${encodeURIComponent(id)}`, id) : "");
export const badge = (text) => h("span", { class: `badge ${text}` }, text);

export function table(columns, rows, empty = "Nothing here.") {
  if (!rows.length) return h("p", { class: "muted" }, empty);
  return h("table", {},
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { class: c.num ? "num" : null }, c.title)))),
    h("tbody", {}, rows.map((row) => h("tr", { "data-id": row.__id ?? null },
      columns.map((c) => h("td", { class: c.num ? "num" : null }, c.cell(row)))))));
}

export function facts(pairs) {
  return h("dl", { class: "facts" },
    pairs.filter(([, v]) => v !== undefined && v !== null && v !== "")
      .map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
}

/** A button that does something destructive only on its second click. */
export function dangerButton(label, action) {
  const button = h("button", { type: "button", class: "danger" }, label);
  button.addEventListener("click", () => {
    if (!button.classList.contains("armed")) {
      button.classList.add("armed");
      button.textContent = `Confirm: ${label.toLowerCase()}`;
      setTimeout(() => { button.classList.remove("armed"); button.textContent = label; }, 5000);
      return;
    }
    action(button);
  });
  return button;
}

export function ago(iso) {
  if (!iso) return "";
  const seconds = (Date.now() - Date.parse(iso)) / 1000;
  return `${duration(Math.abs(seconds))} ${seconds >= 0 ? "ago" : "from now"}`;
}

export function duration(seconds) {
  if (seconds < 60) return `${Math.round(seconds)}s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)}m`;
  if (seconds < 86400) return `${(seconds / 3600).toFixed(1)}h`;
  return `${(seconds / 86400).toFixed(1)}d`;
}

export function bytes(n) {
  if (n === undefined || n === null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export const time = (iso) => (iso ? new Date(iso).toLocaleString() : "");
