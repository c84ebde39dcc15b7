// The console's pages (docs/console.md). Routing is by the URL's fragment (#/sandboxes/ID...),
// so the server serves one page and the browser never sends the route anywhere.
import { ApiError, api, clearKey, clientIdOf, del, get, getKey, post, setKey } from "./api.js";
import { lineChart } from "./chart.js";
import {
  ago, badge, bytes, dangerButton, duration, facts, h, link, sandboxLink, table, time,
} from "./dom.js";
import { openTerminal } from "./term.js";

const main = () => document.getElementById("main");
let leaving = [];  // what the current page stops when another is shown (timers, a terminal)
const onLeave = (fn) => leaving.push(fn);
const every = (ms, fn) => { const id = setInterval(fn, ms); onLeave(() => clearInterval(id)); };

const routes = [
  [/^#\/sandboxes\/([^/]+)$/, sandboxPage],
  [/^#\/sandboxes$/, sandboxesPage],
  [/^#\/templates\/(.+)$/, templatePage],
  [/^#\/templates$/, templatesPage],
  [/^#\/snapshots$/, snapshotsPage],
  [/^#\/nodes$/, nodesPage],
  [/^#\/events$/, eventsPage],
];

async function render() {
  for (const fn of leaving) fn();
  leaving = [];
  const signedIn = Boolean(getKey());
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("logout").hidden = !signedIn;
  const root = main();
  if (!signedIn) { loginPage(root); return; }
  const hash = location.hash || "#/sandboxes";
  for (const a of document.querySelectorAll("#nav a")) {
    a.classList.toggle("active", hash.startsWith(`#/${a.dataset.page}`));
  }
  const found = routes.find(([pattern]) => pattern.test(hash));
  if (!found) { location.hash = "#/sandboxes"; return; }
  const args = hash.match(found[0]).slice(1).map(decodeURIComponent);
  root.replaceChildren(h("p", { class: "muted" }, "Loading…"));
  try {
    await found[1](root, ...args);
  } catch (err) {
    failed(root, err);
  }
}

function failed(root, err) {
  if (err instanceof ApiError && err.status === 401) {  // the key stopped working
    clearKey();
    loginPage(root, err.message);
    document.getElementById("nav").hidden = true;
    document.getElementById("logout").hidden = true;
    return;
  }
  root.replaceChildren(h("p", { class: "error", id: "page-error" }, `Error: ${err.message}`));
}

/** Runs an action of a button: disabled meanwhile, its error shown in `out`. */
async function act(button, out, fn) {
  button.disabled = true;
  out.textContent = "";
  out.className = "note";
  try {
    await fn();
  } catch (err) {
    out.className = "note error";
    out.textContent = err.message;
  } finally {
    button.disabled = false;
  }
}

// --- login ---------------------------------------------------------------------------------

function loginPage(root, message) {
  const input = h("input", { type: "password", id: "api-key", name: "api-key",
                             autocomplete: "off", required: true, placeholder: "e2b_…" });
  const error = h("p", { class: "error", id: "login-error" }, message || "");
  const form = h("form", { class: "login", id: "login" },
    h("h1", {}, "Sign in"),
    h("label", {}, "API key", input),
    h("p", { class: "muted" }, "Kept in this tab only (sessionStorage), sent as X-API-KEY."),
    error,
    h("button", { type: "submit", class: "primary" }, "Sign in"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    const key = input.value.trim();
    try {
      await api("GET", "/v2/sandboxes", { query: { limit: 1 }, key });
    } catch (err) {
      error.textContent = err.status === 401 ? `Sign-in failed: ${err.message}` : err.message;
      return;
    }
    setKey(key);
    if (!location.hash || location.hash === "#/login") location.hash = "#/sandboxes";
    else render();
  });
  root.replaceChildren(form);
  input.focus();
}

// --- sandboxes -----------------------------------------------------------------------------

const AGES = [["", "any age"], ["lt:900", "started < 15 min ago"], ["lt:3600", "started < 1 h ago"],
  ["lt:86400", "started < 24 h ago"], ["gt:3600", "started > 1 h ago"],
  ["gt:86400", "started > 24 h ago"], ["gt:604800", "started > 7 d ago"]];

/** E2B's metadata filter: `k=v&k2=v2`, each key and value encoded (docs/e2b-api.md §1.5). */
function metadataQuery(text) {
  const pairs = text.split(/[&,]/).map((p) => p.trim()).filter(Boolean);
  return pairs.map((pair) => {
    const [k, ...v] = pair.split("=");
    return `${encodeURIComponent(k.trim())}=${encodeURIComponent(v.join("=").trim())}`;
  }).join("&");
}

async function nodeNames() {
  const names = new Map();  // clientID -> node id
  try {
    const { data } = await get("/nodes");
    for (const node of data) {
      const id = await clientIdOf(node.nodeID || node.id);
      if (id) names.set(id, node.nodeID || node.id);
    }
  } catch { /* the list works without names */ }
  return names;
}

async function sandboxesPage(root) {
  const params = new URLSearchParams(sessionStorage.getItem("aenv-console-filters") || "");
  const field = (name, attrs) => h("input", { name, value: params.get(name) || "", ...attrs });
  const select = (name, options) => {
    const el = h("select", { name }, options.map(([v, t]) => h("option", { value: v }, t)));
    el.value = params.get(name) || "";
    return el;
  };
  const names = await nodeNames();
  const form = h("form", { class: "filters", id: "filters" },
    h("label", {}, "State", select("state", [["", "running and paused"], ["running", "running"],
                                             ["paused", "paused"]])),
    h("label", {}, "Template", field("template", { placeholder: "id or name" })),
    h("label", {}, "Metadata", field("metadata", { placeholder: "key=value, …" })),
    h("label", {}, "Age", select("age", AGES)),
    h("label", {}, "Node", select("node", [["", "any node"], ...[...names].map(([c, n]) => [c, n])])),
    h("label", {}, "Forked from", field("parent", { placeholder: "sandbox id" })),
    h("button", { type: "submit", class: "primary" }, "Filter"),
    h("button", { type: "button", id: "new-sandbox" }, "New sandbox"));
  const summary = h("p", { class: "muted", id: "summary" });
  const out = h("p", { class: "note" });
  const list = h("div", { id: "sandbox-list" });
  const more = h("button", { type: "button", hidden: true }, "More");
  root.replaceChildren(h("h1", {}, "Sandboxes"), form, out, summary, list, more);

  let rows = [];
  let nextToken = null;
  const columns = [
    { title: "Sandbox", cell: (s) => sandboxLink(s.sandboxID) },
    { title: "State", cell: (s) => badge(s.state) },
    { title: "Template", cell: (s) => s.alias || s.templateID },
    { title: "Started", cell: (s) => ago(s.startedAt) },
    { title: "Ends", cell: (s) => (s.state === "running" ? ago(s.endAt) : "") },
    { title: "Node", cell: (s) => names.get(s.clientID) || s.clientID },
    { title: "CPU / memory", cell: (s) => `${s.cpuCount} vCPU, ${s.memoryMB} MiB` },
    { title: "CPU used", num: true, cell: (s) => (s.metric ? `${s.metric.cpuUsedPct.toFixed(1)}%` : "") },
    { title: "Memory used", num: true, cell: (s) => (s.metric ? bytes(s.metric.memUsed) : "") },
    { title: "Lineage", cell: (s) => [s.parentSandboxID ? ["fork of ", sandboxLink(s.parentSandboxID)] : "",
                                      s.sourceSnapshotID ? ` from ${s.sourceSnapshotID}` : ""] },
    { title: "Metadata", cell: (s) => h("span", { class: "mono" },
      Object.entries(s.metadata || {}).map(([k, v]) => `${k}=${v}`).join(" ")) },
  ];

  function wanted(s, age, node, parent) {
    if (node && s.clientID !== node) return false;
    if (parent && s.parentSandboxID !== parent) return false;
    if (age.startsWith("gt:")) {
      return (Date.now() - Date.parse(s.startedAt)) / 1000 > Number(age.slice(3));
    }
    return true;
  }

  let f = new FormData(form);  // the filters applied: the refresh keeps to them while one types
  async function load(append) {
    sessionStorage.setItem("aenv-console-filters", new URLSearchParams(f).toString());
    const age = f.get("age");
    const query = {
      limit: 100, state: f.get("state"), template: f.get("template").trim(),
      metadata: metadataQuery(f.get("metadata")),
      startedAfter: age.startsWith("lt:")
        ? new Date(Date.now() - Number(age.slice(3)) * 1000).toISOString() : "",
      nextToken: append ? nextToken : "",
    };
    const { data, headers } = await get("/v2/sandboxes", query);
    nextToken = headers.get("X-Next-Token");
    const found = data.filter((s) => wanted(s, age, f.get("node"), f.get("parent").trim()));
    if (found.length) {  // the latest sample of each, in batches the API takes
      for (let i = 0; i < found.length; i += 100) {
        const ids = found.slice(i, i + 100).map((s) => s.sandboxID).join(",");
        const { data: m } = await get("/sandboxes/metrics", { sandbox_ids: ids }).catch(() => ({ data: {} }));
        for (const s of found) if (m.sandboxes && m.sandboxes[s.sandboxID]) s.metric = m.sandboxes[s.sandboxID];
      }
    }
    for (const s of found) s.__id = s.sandboxID;
    rows = append ? rows.concat(found) : found;
    summary.textContent = `${rows.length} shown; ${headers.get("X-Total-Running") ?? "?"} running match the filters`;
    list.replaceChildren(table(columns, rows, "No sandboxes match."));
    more.hidden = !nextToken;
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    f = new FormData(form);
    load(false).catch((err) => failed(root, err));
  });
  more.addEventListener("click", () => load(true).catch((err) => failed(root, err)));
  const create = form.querySelector("#new-sandbox");
  create.addEventListener("click", () => act(create, out, async () => {
    const template = new FormData(form).get("template").trim() || "base";
    const { data } = await api("POST", "/v2/sandboxes", { body: { templateID: template, timeout: 300 } });
    location.hash = `#/sandboxes/${encodeURIComponent(data.sandboxID)}`;
  }));
  await load(false);
  every(10000, () => load(false).catch(() => {}));
}

async function sandboxPage(root, id) {
  const path = `/sandboxes/${encodeURIComponent(id)}`;
  const { data: s } = await get(path);
  const out = h("p", { class: "note", id: "action-result" });
  const after = (message) => { out.textContent = message; };
  const button = (label, fn, attrs = {}) => {
    const b = h("button", { type: "button", ...attrs }, label);
    b.addEventListener("click", () => act(b, out, fn));
    return b;
  };
  const running = s.state === "running";
  const actions = h("div", { class: "actions" },
    running ? button("Pause", async () => { await post(`${path}/pause`); render(); }, { id: "pause" }) : null,
    running ? null : button("Resume", async () => {
      await post(`/v2/sandboxes/${encodeURIComponent(id)}/connect`, { timeout: 300 });
      render();
    }, { id: "resume" }),
    running ? button("Extend 5 min", async () => {
      await post(`${path}/timeout`, { timeout: Math.max(300, (Date.parse(s.endAt) - Date.now()) / 1000 + 300) | 0 });
      render();
    }) : null,
    button("Fork", async () => {
      const { data } = await post(`${path}/fork`, { count: 1, timeout: 300 });
      const child = data[0];
      if (child.error) throw new Error(`fork failed: ${child.error.message}`);
      out.replaceChildren("Forked: ", sandboxLink(child.sandbox.sandboxID));
    }, { id: "fork" }),
    running ? button("Snapshot", async () => {
      const { data } = await post(`${path}/snapshots`, {});
      after(`Snapshot ${data.snapshotID} taken.`);
    }, { id: "snapshot" }) : null,
    dangerButton("Kill", (b) => act(b, out, async () => {
      await del(path);
      location.hash = "#/sandboxes";
    })));
  actions.lastChild.id = "kill";

  const detail = facts([
    ["State", [badge(s.state), s.pauseMode ? ` (${s.pauseMode} pause)` : ""]],
    ["Template", s.alias ? `${s.alias} (${s.templateID})` : s.templateID],
    ["Started", `${time(s.startedAt)} (${ago(s.startedAt)})`],
    ["Ends", running ? `${time(s.endAt)} (${ago(s.endAt)}, then ${s.lifecycle?.onTimeout ?? "kill"})` : ""],
    ["Resources", `${s.cpuCount} vCPU, ${s.memoryMB} MiB memory, ${s.diskSizeMB} MiB disk`],
    ["envd", s.envdVersion],
    ["Forked from", s.parentSandboxID ? sandboxLink(s.parentSandboxID) : ""],
    ["Made from snapshot", s.sourceSnapshotID || ""],
    ["Internet", s.allowInternetAccess === false ? "denied" : "allowed"],
    ["Metadata", Object.keys(s.metadata || {}).length
      ? h("span", { class: "mono" }, Object.entries(s.metadata).map(([k, v]) => `${k}=${v}`).join(" ")) : ""],
  ]);
  const metrics = h("div", { id: "metrics" });
  const children = h("div", { id: "children" });
  const events = h("div", { id: "events" });
  const logs = h("pre", { class: "logs", id: "logs" });
  const termStatus = h("p", { class: "muted", id: "terminal-status" },
    running ? "" : "Resume the sandbox to open a terminal.");
  const term = h("pre", { class: "terminal", id: "terminal", tabindex: "0", hidden: true });
  const openTerm = h("button", { type: "button", id: "open-terminal", disabled: !running }, "Open terminal");
  openTerm.addEventListener("click", () => {
    openTerm.disabled = true;
    term.hidden = false;
    const session = openTerminal(term, termStatus, id, s.envdAccessToken);
    onLeave(() => session.close());
  });

  root.replaceChildren(
    h("h1", {}, "Sandbox ", h("span", { class: "mono", id: "sandbox-id" }, id)),
    actions, out, detail,
    h("h2", {}, "Metrics"), metrics,
    h("h2", {}, "Terminal"), openTerm, termStatus, term,
    h("div", { class: "grid2" },
      h("section", {}, h("h2", {}, "Events"), events),
      h("section", {}, h("h2", {}, "Forks and sandboxes from its snapshots"), children)),
    h("h2", {}, "Logs"), logs);

  async function refresh() {
    const since = Math.floor(Date.now() / 1000) - 3600;
    const [m, e, l, c] = await Promise.allSettled([
      get(`${path}/metrics`, { start: since }),
      get(`/events/sandboxes/${encodeURIComponent(id)}`, { limit: 50 }),
      get(`/v2/sandboxes/${encodeURIComponent(id)}/logs`, { direction: "backward", limit: 300 }),
      get(`${path}/children`),
    ]);
    const show = (el, result, fn) => {
      if (result.status === "fulfilled") el.replaceChildren(fn(result.value.data));
      else el.replaceChildren(h("p", { class: "error" }, result.reason.message));
    };
    show(metrics, m, (samples) => h("div", { class: "grid2" },
      lineChart("CPU used (%)", [{ name: "CPU", points: samples.map((x) => [x.timestampUnix, x.cpuUsedPct]) }],
                { max: 100, format: (v) => `${v.toFixed(0)}%` }),
      lineChart("Memory", [
        { name: "guest used", points: samples.map((x) => [x.timestampUnix, x.memUsed]) },
        { name: "host resident", points: samples.filter((x) => x.memUsedHost !== undefined).map((x) => [x.timestampUnix, x.memUsedHost]) },
        { name: "disk used", points: samples.map((x) => [x.timestampUnix, x.diskUsed]) },
      ], { format: bytes })));
    show(events, e, (list) => table([
      { title: "Time", cell: (x) => time(x.timestamp) },
      { title: "Event", cell: (x) => x.type.replace(/^sandbox\.lifecycle\./, "") },
      { title: "Details", cell: (x) => h("span", { class: "mono" }, eventData(x)) },
    ], list, "No events."));
    show(children, c, (list) => table([
      { title: "Sandbox", cell: (x) => sandboxLink(x.sandboxID) },
      { title: "State", cell: (x) => badge(x.state) },
      { title: "Started", cell: (x) => ago(x.startedAt) },
    ], list, "None."));
    if (l.status === "fulfilled") {
      const lines = [...l.value.data.logs].reverse();
      logs.textContent = lines.map((x) => `${x.timestamp}  ${x.message}`).join("\n") || "(no log lines)";
    } else logs.textContent = l.reason.message;
  }
  await refresh();
  every(5000, () => refresh().catch(() => {}));
}

function eventData(event) {
  const data = { ...(event.eventData || {}) };
  delete data.execution;
  return Object.entries(data).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
}

// --- templates and builds ------------------------------------------------------------------

async function templatesPage(root) {
  const { data } = await get("/v2/templates", { limit: 100 });
  root.replaceChildren(h("h1", {}, "Templates"), table([
    { title: "Template", cell: (t) => link(`#/templates/${encodeURIComponent(t.templateID)}`, (t.names || t.aliases || []).join(", ") || t.templateID) },
    { title: "Id", cell: (t) => h("span", { class: "mono" }, t.templateID) },
    { title: "Build", cell: (t) => badge(t.buildStatus || "ready") },
    { title: "Resources", cell: (t) => `${t.cpuCount} vCPU, ${t.memoryMB} MiB, ${t.diskSizeMB} MiB disk` },
    { title: "envd", cell: (t) => t.envdVersion },
    { title: "Builds", num: true, cell: (t) => t.buildCount },
    { title: "Sandboxes made", num: true, cell: (t) => t.spawnCount },
    { title: "Updated", cell: (t) => ago(t.updatedAt) },
  ], data, "No templates."));
}

async function buildLogs(templateId, buildId) {
  const lines = [];
  let body;
  for (;;) {  // the status route gives at most 100 entries a call
    ({ data: body } = await get(`/templates/${encodeURIComponent(templateId)}/builds/${encodeURIComponent(buildId)}/status`,
                                { logsOffset: lines.length }));
    const entries = body.logEntries || [];
    lines.push(...entries.map((e) => `${e.timestamp}  ${e.level.padEnd(5)} ${e.message}`));
    if (entries.length < 100) break;
  }
  if (body.reason) lines.push(`reason: ${body.reason.message ?? JSON.stringify(body.reason)}`);
  return { status: body.status, text: lines.join("\n") || "(no log lines)" };
}

async function templatePage(root, id) {
  const { data: t } = await get(`/templates/${encodeURIComponent(id)}`);
  const out = h("p", { class: "note" });
  const logs = h("pre", { class: "logs", id: "build-logs", hidden: true });
  const kill = dangerButton("Delete template", (b) => act(b, out, async () => {
    await del(`/templates/${encodeURIComponent(id)}`);
    location.hash = "#/templates";
  }));
  root.replaceChildren(
    h("h1", {}, "Template ", h("span", { class: "mono" }, (t.names || []).join(", ") || id)),
    h("div", { class: "actions" }, kill), out,
    facts([["Id", t.templateID], ["Names", (t.names || t.aliases || []).join(", ")],
           ["Resources", `${t.cpuCount} vCPU, ${t.memoryMB} MiB memory, ${t.diskSizeMB} MiB disk`],
           ["envd", t.envdVersion], ["Created", time(t.createdAt)], ["Sandboxes made", t.spawnCount],
           ["Last made", t.lastSpawnedAt ? ago(t.lastSpawnedAt) : "never"]]),
    h("h2", {}, "Builds"),
    table([
      { title: "Build", cell: (b) => h("span", { class: "mono" }, b.buildID) },
      { title: "Status", cell: (b) => badge(b.status) },
      { title: "Created", cell: (b) => time(b.createdAt) },
      { title: "Took", cell: (b) => (b.finishedAt ? duration((Date.parse(b.finishedAt) - Date.parse(b.createdAt)) / 1000) : "") },
      { title: "", cell: (b) => {
        const show = h("button", { type: "button" }, "Logs");
        show.addEventListener("click", () => act(show, out, async () => {
          const got = await buildLogs(t.templateID, b.buildID);
          logs.hidden = false;
          logs.textContent = got.text;
        }));
        return show;
      } },
    ], t.builds || [], "No builds."),
    logs);
}

// --- snapshots -----------------------------------------------------------------------------

async function snapshotsPage(root) {
  const { data } = await get("/snapshots", { limit: 100 });
  const out = h("p", { class: "note" });
  root.replaceChildren(h("h1", {}, "Snapshots"), out, table([
    { title: "Snapshot", cell: (x) => h("span", { class: "mono" }, x.snapshotID) },
    { title: "Names", cell: (x) => (x.names || []).join(", ") },
    { title: "Of sandbox", cell: (x) => sandboxLink(x.sandboxID) },
    { title: "Resources", cell: (x) => `${x.cpuCount} vCPU, ${x.memoryMB} MiB` },
    { title: "Taken", cell: (x) => `${time(x.createdAt)} (${ago(x.createdAt)})` },
    { title: "", cell: (x) => {
      const start = h("button", { type: "button" }, "Start a sandbox");
      start.addEventListener("click", () => act(start, out, async () => {
        const { data: made } = await post("/v2/sandboxes", { templateID: x.snapshotID, timeout: 300 });
        location.hash = `#/sandboxes/${encodeURIComponent(made.sandboxID)}`;
      }));
      return h("span", { class: "actions" }, start, dangerButton("Delete", (b) => act(b, out, async () => {
        await del(`/templates/${encodeURIComponent(x.snapshotID)}`);
        render();
      })));
    } },
  ], data, "No snapshots."));
}

// --- nodes ---------------------------------------------------------------------------------

function gauge(label, used, total, format) {
  if (used === undefined || total === undefined || !total) return "";
  return h("span", {}, h("meter", { min: 0, max: total, value: used, low: total * 0.7,
                                    high: total * 0.9, optimum: 0, title: label }),
           ` ${format(used)} / ${format(total)}`);
}

async function nodesPage(root) {
  const { data } = await get("/nodes");
  const cards = await Promise.all(data.map(async (n) => {
    let cached = "";
    if (n.status !== "unhealthy") {
      try {
        const { data: d } = await get(`/nodes/${encodeURIComponent(n.nodeID || n.id)}`);
        cached = `${(d.cachedBuilds || []).length}`;
      } catch { /* shown without it */ }
    }
    const m = n.metrics || {};
    const disk = (m.disks || [])[0] || {};
    return h("section", { class: "card node", "data-id": n.nodeID || n.id },
      h("h2", {}, n.nodeID || n.id, " ", badge(n.status)),
      facts([
        ["Backend", n.backend], ["Version", n.version],
        ["Sandboxes", n.sandboxCount === undefined ? "" :
          `${n.sandboxCount} running, ${n.sandboxStartingCount} starting, ${n.sandboxPausedCount} paused`],
        ["Creates", n.createSuccesses === undefined ? "" : `${n.createSuccesses} made, ${n.createFails} failed`],
        ["vCPUs allocated", gauge("vCPUs", m.allocatedCPU, m.cpuCount, String)],
        ["Memory allocated", gauge("memory", m.allocatedMemoryBytes, m.memoryTotalBytes, bytes)],
        ["Paused holds", m.pausedAllocatedCPU === undefined ? "" :
          `${m.pausedAllocatedCPU} vCPU, ${bytes(m.pausedAllocatedMemoryBytes)}`],
        ["Load (CPU)", m.cpuPercent === undefined ? "" : gauge("load", m.cpuPercent, 100, (v) => `${v}%`)],
        ["Memory used", gauge("memory used", m.memoryUsedBytes, m.memoryTotalBytes, bytes)],
        ["Disk", disk.usedBytes === undefined ? (disk.totalBytes ? bytes(disk.totalBytes) : "")
          : gauge("disk", disk.usedBytes, disk.totalBytes, bytes)],
        ["Cached builds", cached],
        ["Machine", n.machineInfo ? `${n.machineInfo.cpuArchitecture} ${n.machineInfo.cpuModelName}` : ""],
      ]));
  }));
  root.replaceChildren(h("h1", {}, "Nodes"), ...(cards.length ? cards : [h("p", { class: "muted" }, "No nodes.")]));
  every(15000, () => { if (document.visibilityState === "visible") render(); });
}

// --- events --------------------------------------------------------------------------------

const EVENT_TYPES = ["created", "paused", "resumed", "updated", "checkpointed", "killed", "forked", "failed"]
  .map((t) => `sandbox.lifecycle.${t}`)
  .concat(["template.build.started", "template.build.finished", "template.build.failed"]);

async function eventsPage(root) {
  const type = h("select", { name: "types" }, h("option", { value: "" }, "every sandbox event"),
                 EVENT_TYPES.map((t) => h("option", { value: t }, t)));
  const list = h("div", { id: "event-list" });
  const prev = h("button", { type: "button" }, "Newer");
  const next = h("button", { type: "button" }, "Older");
  const limit = 50;
  let offset = 0;
  async function load() {
    const { data } = await get("/events/sandboxes", { limit, offset, types: type.value || undefined });
    list.replaceChildren(table([
      { title: "Time", cell: (e) => time(e.timestamp) },
      { title: "Event", cell: (e) => e.type },
      { title: "Sandbox", cell: (e) => sandboxLink(e.sandboxId) },
      { title: "Template", cell: (e) => e.sandboxTemplateId || "" },
      { title: "Node", cell: (e) => e.nodeId || "" },
      { title: "Details", cell: (e) => h("span", { class: "mono" }, eventData(e)) },
    ], data, "No events."));
    prev.disabled = offset === 0;
    next.disabled = data.length < limit;
  }
  type.addEventListener("change", () => { offset = 0; load().catch((err) => failed(root, err)); });
  prev.addEventListener("click", () => { offset = Math.max(0, offset - limit); load().catch((err) => failed(root, err)); });
  next.addEventListener("click", () => { offset += limit; load().catch((err) => failed(root, err)); });
  root.replaceChildren(h("h1", {}, "Events"),
    h("form", { class: "filters" }, h("label", {}, "Type", type)), list,
    h("div", { class: "actions" }, prev, next));
  await load();
}

// --- start ---------------------------------------------------------------------------------

window.addEventListener("hashchange", render);
document.getElementById("logout").addEventListener("click", () => {
  clearKey();
  sessionStorage.removeItem("aenv-console-filters");
  location.hash = "#/login";
  render();
});
render();
