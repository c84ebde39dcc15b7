// A terminal into a sandbox: envd's process.Process/Start with a PTY (docs/e2b-api.md §3.2),
// spoken by the browser itself. Start is a Connect server stream with the JSON codec: a POST of
// one envelope (1 flag byte, 4 length bytes, JSON), answered by envelopes that fetch() reads as
// they arrive. Input and resizes are unary calls. Requests go through the sandbox proxy
// (E2b-Sandbox-Id) with the sandbox's envd token, never with the API key.
//
// The screen is a small VT100 subset (cursor moves, erases, insert/delete, scroll region,
// the alternate screen); colours and other attributes are dropped. Enough for a shell, less
// and top; not a full xterm.

const MAX_SCROLLBACK = 2000;

export class Screen {
  constructor(cols, rows) {
    this.cols = cols;
    this.rows = rows;
    this.scrollback = [];
    this.main = null;
    this.reset();
  }

  reset() {
    this.grid = this.blankGrid();
    this.x = 0; this.y = 0;
    this.top = 0; this.bottom = this.rows - 1;
    this.state = "normal"; this.params = ""; this.saved = [0, 0];
  }

  blankGrid() { return Array.from({ length: this.rows }, () => this.blankRow()); }
  blankRow() { return new Array(this.cols).fill(" "); }

  /** The whole text: scrollback, then the screen, the cursor's cell marked by its index. */
  lines() { return [...this.scrollback, ...this.grid.map((row) => row.join("").trimEnd())]; }

  write(text, reply) {
    for (const ch of text) this.feed(ch, reply);
  }

  feed(ch, reply) {
    const code = ch.codePointAt(0);
    switch (this.state) {
      case "esc": return this.escape(ch);
      case "csi":
        if (code >= 0x40 && code <= 0x7e) { this.state = "normal"; this.csi(ch, reply); }
        else this.params += ch;
        return;
      case "osc":
        if (ch === "\x07") this.state = "normal";
        else if (ch === "\x1b") this.state = "osc-esc";
        return;
      case "osc-esc": this.state = ch === "\\" ? "normal" : "osc"; return;
      case "charset": this.state = "normal"; return;
      default: break;
    }
    if (code < 0x20 || code === 0x7f) {
      if (ch === "\x1b") this.state = "esc";
      else if (ch === "\r") this.x = 0;
      else if (ch === "\n" || ch === "\x0b" || ch === "\x0c") this.lineFeed();
      else if (ch === "\b") this.x = Math.max(0, Math.min(this.x, this.cols - 1) - 1);
      else if (ch === "\t") this.x = Math.min(this.cols - 1, (Math.floor(this.x / 8) + 1) * 8);
      return;
    }
    if (this.x >= this.cols) { this.x = 0; this.lineFeed(); }  // the pending wrap
    this.grid[this.y][this.x] = ch;
    this.x += 1;
  }

  escape(ch) {
    this.state = "normal";
    if (ch === "[") { this.state = "csi"; this.params = ""; }
    else if (ch === "]") this.state = "osc";
    else if (ch === "(" || ch === ")") this.state = "charset";
    else if (ch === "7") this.saved = [this.x, this.y];
    else if (ch === "8") [this.x, this.y] = this.saved;
    else if (ch === "M") this.reverseIndex();
    else if (ch === "D") this.lineFeed();
    else if (ch === "E") { this.x = 0; this.lineFeed(); }
    else if (ch === "c") { this.reset(); }
  }

  lineFeed() {
    if (this.y === this.bottom) this.scrollUp(1);
    else if (this.y < this.rows - 1) this.y += 1;
  }

  reverseIndex() {
    if (this.y === this.top) this.scrollDown(1);
    else if (this.y > 0) this.y -= 1;
  }

  scrollUp(n) {
    for (let i = 0; i < n; i += 1) {
      const [gone] = this.grid.splice(this.top, 1);
      if (this.top === 0 && !this.main) {
        this.scrollback.push(gone.join("").trimEnd());
        if (this.scrollback.length > MAX_SCROLLBACK) this.scrollback.shift();
      }
      this.grid.splice(this.bottom, 0, this.blankRow());
    }
  }

  scrollDown(n) {
    for (let i = 0; i < n; i += 1) {
      this.grid.splice(this.bottom, 1);
      this.grid.splice(this.top, 0, this.blankRow());
    }
  }

  csi(final, reply) {
    const priv = this.params.startsWith("?");
    const args = (priv ? this.params.slice(1) : this.params).split(";").map((p) => parseInt(p, 10));
    const n = (i, fallback = 1) => (Number.isNaN(args[i]) || args[i] === undefined ? fallback : args[i]) || fallback;
    // a count of lines or cells does nothing more past the screen's size: a guest's huge one
    // (ESC[999999999S) must not loop or allocate that many times on the page's thread
    const lines = () => Math.min(n(0), this.rows);
    const cells = () => Math.min(n(0), this.cols);
    const clampX = (v) => Math.max(0, Math.min(this.cols - 1, v));
    const clampY = (v) => Math.max(0, Math.min(this.rows - 1, v));
    const row = this.grid[this.y];
    switch (final) {
      case "A": this.y = Math.max(this.top, this.y - n(0)); break;
      case "B": case "e": this.y = Math.min(this.bottom, this.y + n(0)); break;
      case "C": case "a": this.x = clampX(this.x + n(0)); break;
      case "D": this.x = clampX(Math.min(this.x, this.cols - 1) - n(0)); break;
      case "E": this.x = 0; this.y = clampY(this.y + n(0)); break;
      case "F": this.x = 0; this.y = clampY(this.y - n(0)); break;
      case "G": case "`": this.x = clampX(n(0) - 1); break;
      case "d": this.y = clampY(n(0) - 1); break;
      case "H": case "f": this.y = clampY(n(0) - 1); this.x = clampX(n(1) - 1); break;
      case "J": {
        const mode = Number.isNaN(args[0]) ? 0 : args[0];
        if (mode === 2 || mode === 3) { this.grid = this.blankGrid(); break; }
        const [from, to] = mode === 0 ? [this.y + 1, this.rows] : [0, this.y];
        for (let r = from; r < to; r += 1) this.grid[r] = this.blankRow();
        this.eraseInLine(mode);
        break;
      }
      case "K": this.eraseInLine(Number.isNaN(args[0]) ? 0 : args[0]); break;
      case "P": row.splice(this.x, cells()); while (row.length < this.cols) row.push(" "); break;
      case "@": row.splice(this.x, 0, ...new Array(cells()).fill(" ")); row.length = this.cols; break;
      case "X": for (let i = 0; i < cells() && this.x + i < this.cols; i += 1) row[this.x + i] = " "; break;
      case "L": if (this.y >= this.top && this.y <= this.bottom) {
        const saved = this.top; this.top = this.y; this.scrollDown(lines()); this.top = saved;
      } break;
      case "M": if (this.y >= this.top && this.y <= this.bottom) {
        const saved = this.top; this.top = this.y; this.scrollUp(lines()); this.top = saved;
      } break;
      case "S": this.scrollUp(lines()); break;
      case "T": this.scrollDown(lines()); break;
      case "r":
        this.top = clampY(n(0) - 1);
        this.bottom = clampY(n(1, this.rows) - 1);
        this.x = 0; this.y = 0;
        break;
      case "s": this.saved = [this.x, this.y]; break;
      case "u": [this.x, this.y] = this.saved; break;
      case "n": if (args[0] === 6 && reply) reply(`\x1b[${this.y + 1};${Math.min(this.x, this.cols - 1) + 1}R`); break;
      case "h": case "l":
        if (priv && [47, 1047, 1049].includes(args[0])) this.alternate(final === "h");
        break;
      default: break;  // m (colours) and the rest: ignored
    }
  }

  eraseInLine(mode) {
    const row = this.grid[this.y];
    const x = Math.min(this.x, this.cols - 1);
    const [from, to] = mode === 0 ? [x, this.cols] : mode === 1 ? [0, x + 1] : [0, this.cols];
    for (let i = from; i < to; i += 1) row[i] = " ";
  }

  alternate(on) {
    if (on && !this.main) {
      this.main = { grid: this.grid, x: this.x, y: this.y };
      this.grid = this.blankGrid();
    } else if (!on && this.main) {
      ({ grid: this.grid, x: this.x, y: this.y } = this.main);
      this.main = null;
    }
  }
}

function envelope(message) {
  const payload = new TextEncoder().encode(JSON.stringify(message));
  const out = new Uint8Array(5 + payload.length);
  new DataView(out.buffer).setUint32(1, payload.length);
  out.set(payload, 5);
  return out;
}

function toBase64(text) {
  let raw = "";
  for (const b of new TextEncoder().encode(text)) raw += String.fromCharCode(b);
  return btoa(raw);
}

function fromBase64(data) {
  return Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
}

const KEYS = {
  Enter: "\r", Backspace: "\x7f", Tab: "\t", Escape: "\x1b", ArrowUp: "\x1b[A",
  ArrowDown: "\x1b[B", ArrowRight: "\x1b[C", ArrowLeft: "\x1b[D", Home: "\x1b[H", End: "\x1b[F",
  Delete: "\x1b[3~", PageUp: "\x1b[5~", PageDown: "\x1b[6~", Insert: "\x1b[2~",
};

/** The bytes a key press sends to the PTY, or null for keys the browser keeps. */
export function keyInput(event) {
  if (event.metaKey) return null;
  if (event.ctrlKey && !event.altKey && event.key.length === 1) {
    const code = event.key.toUpperCase().charCodeAt(0);
    if (code >= 64 && code <= 95) return String.fromCharCode(code - 64);
    return null;
  }
  if (KEYS[event.key]) return KEYS[event.key];
  if (event.key.length === 1 || [...event.key].length === 1) return (event.altKey ? "\x1b" : "") + event.key;
  return null;
}

/** A shell in `sandboxId` shown in `pre` (a focusable <pre>); returns {close()}. */
export function openTerminal(pre, status, sandboxId, token, { cols = 100, rows = 28 } = {}) {
  const screen = new Screen(cols, rows);
  const abort = new AbortController();
  const decoder = new TextDecoder();
  let pid = null;
  let queue = Promise.resolve();
  let drawn = false;
  const envdHeaders = (contentType) => {
    const headers = { "E2b-Sandbox-Id": sandboxId, "Content-Type": contentType };
    if (token) headers["X-Access-Token"] = token;
    return headers;
  };
  const unary = (method, message) => fetch(`/process.Process/${method}`, {
    method: "POST", headers: envdHeaders("application/json"), credentials: "omit",
    body: JSON.stringify(message),
  });

  const draw = () => {
    drawn = false;
    const lines = screen.lines();
    const at = screen.scrollback.length + screen.y;
    const line = lines[at].padEnd(screen.cols, " ");
    const x = Math.min(screen.x, screen.cols - 1);
    const cursor = document.createElement("span");
    cursor.className = "cursor";
    cursor.textContent = line[x];
    const before = [...lines.slice(0, at), line.slice(0, x)].join("\n");
    const after = [line.slice(x + 1).trimEnd(), ...lines.slice(at + 1)].join("\n").trimEnd();
    pre.replaceChildren(before, cursor, after);
    pre.scrollTop = pre.scrollHeight;
  };
  const schedule = () => { if (!drawn) { drawn = true; requestAnimationFrame(draw); } };
  // one input call at a time, in order: keystrokes must not overtake each other
  const send = (text) => {
    if (pid === null || !text) return;
    queue = queue.then(() => unary("SendInput", { process: { pid }, input: { pty: toBase64(text) } }))
      .catch((err) => { status.textContent = `input failed: ${err.message}`; });
  };

  pre.addEventListener("keydown", (event) => {
    const input = keyInput(event);
    if (input === null) return;
    event.preventDefault();
    send(input);
  });
  pre.addEventListener("paste", (event) => {
    event.preventDefault();
    send(event.clipboardData.getData("text"));
  });

  async function start(cmd, args) {
    const res = await fetch("/process.Process/Start", {
      method: "POST", signal: abort.signal, credentials: "omit",
      headers: { ...envdHeaders("application/connect+json"), "Keepalive-Ping-Interval": "30" },
      body: envelope({
        process: { cmd, args, envs: { TERM: "xterm" } },
        pty: { size: { cols, rows } },
      }),
    });
    if (!res.ok || !res.body) {
      let message = `${res.status}`;
      try { message = (await res.json()).message || message; } catch { /* not JSON */ }
      throw new Error(`the sandbox answered ${message}`);
    }
    const reader = res.body.getReader();
    let buffer = new Uint8Array(0);
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return { ended: true };
      const joined = new Uint8Array(buffer.length + value.length);
      joined.set(buffer); joined.set(value, buffer.length);
      buffer = joined;
      while (buffer.length >= 5) {
        const size = new DataView(buffer.buffer, buffer.byteOffset).getUint32(1);
        if (buffer.length < 5 + size) break;
        const flags = buffer[0];
        const message = JSON.parse(decoder.decode(buffer.subarray(5, 5 + size)));
        buffer = buffer.slice(5 + size);
        if (flags & 2) {  // end of stream
          if (message.error) return { error: message.error, started: pid !== null };
          return { ended: true };
        }
        const event = message.event || {};
        if (event.start) {
          pid = event.start.pid;
          status.textContent = `connected: pid ${pid} (${cmd})`;
          pre.focus();
        } else if (event.data && event.data.pty) {
          screen.write(decoder.decode(fromBase64(event.data.pty), { stream: true }), send);
          schedule();
        } else if (event.end) {
          status.textContent = `the shell ended: ${event.end.status || "exited"}`;
        }
      }
    }
  }

  (async () => {
    status.textContent = "connecting…";
    draw();
    try {
      // bash as the SDK's pty.create runs it; a shell-less image falls back to sh
      let result = await start("/bin/bash", ["-i", "-l"]);
      if (result.error && !result.started) result = await start("/bin/sh", ["-i"]);
      if (result.error) status.textContent = `terminal error: ${result.error.message}`;
      else if (!status.textContent.startsWith("the shell ended")) status.textContent = "disconnected";
    } catch (err) {
      if (!abort.signal.aborted) status.textContent = `terminal error: ${err.message}`;
    }
    pid = null;
  })();

  return {
    close() {
      // the process belongs to envd, not to this stream (§3.2): end it with the page
      if (pid !== null) unary("SendSignal", { process: { pid }, signal: "SIGNAL_SIGKILL" }).catch(() => {});
      pid = null;
      abort.abort();
    },
  };
}
