// A small hand-drawn SVG line chart (no charting library: two series of a few hundred points
// need none). Colours come from style.css classes, so the chart needs no inline style.
import { h } from "./dom.js";

const NS = "http://www.w3.org/2000/svg";

function s(tag, attrs, text) {
  const el = document.createElementNS(NS, tag);
  for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, String(value));
  if (text !== undefined) el.textContent = text;
  return el;
}

/** series: [{name, points: [[unixSeconds, value], ...]}]; format(value) labels the y axis. */
export function lineChart(title, series, { max, format = String, width = 600, height = 170 } = {}) {
  const left = 64, right = 10, top = 10, bottom = 22;
  const all = series.flatMap((one) => one.points);
  const svg = s("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, role: "img",
                         "aria-label": title });
  if (!all.length) {
    svg.append(s("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, "no samples yet"));
    return h("figure", { class: "card" }, h("figcaption", {}, title), svg);
  }
  const t0 = Math.min(...all.map((p) => p[0]));
  const t1 = Math.max(t0 + 1, ...all.map((p) => p[0]));
  const yMax = max ?? Math.max(1, ...all.map((p) => p[1])) * 1.1;
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (width - left - right);
  const y = (v) => top + (1 - Math.min(v, yMax) / yMax) * (height - top - bottom);
  for (const frac of [0, 0.5, 1]) {
    svg.append(s("line", { class: "axis", x1: left, x2: width - right, y1: y(yMax * frac),
                           y2: y(yMax * frac) }));
    svg.append(s("text", { x: left - 6, y: y(yMax * frac) + 4, "text-anchor": "end" },
                 format(yMax * frac)));
  }
  const clock = (t) => new Date(t * 1000).toLocaleTimeString();
  svg.append(s("text", { x: left, y: height - 6 }, clock(t0)));
  svg.append(s("text", { x: width - right, y: height - 6, "text-anchor": "end" }, clock(t1)));
  series.forEach((one, i) => {
    const points = one.points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    svg.append(s("polyline", { class: `s${i}`, points }));
  });
  return h("figure", { class: "card" }, h("figcaption", {}, title), svg,
    h("div", { class: "legend" }, series.map((one, i) => h("span", { class: `s${i}` }, one.name))));
}
