// The console is a client of the node's (or gateway's) E2B API: the key the user typed is kept
// in this tab's sessionStorage only and sent as X-API-KEY, never to a sandbox.
const KEY = "aenv-console-key";

export const getKey = () => sessionStorage.getItem(KEY);
export const setKey = (key) => sessionStorage.setItem(KEY, key);
export const clearKey = () => sessionStorage.removeItem(KEY);

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

/** One call of the JSON API: {data, headers}; an ApiError with the API's own message. */
export async function api(method, path, { query, body, key } = {}) {
  const url = new URL(path, location.origin);
  for (const [name, value] of Object.entries(query || {})) {
    if (value === undefined || value === null || value === "") continue;
    for (const one of Array.isArray(value) ? value : [value]) url.searchParams.append(name, one);
  }
  const headers = { "X-API-KEY": key ?? getKey() ?? "" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(url, {
    method, headers, cache: "no-store", credentials: "omit",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  let data = null;
  if (text) {
    try { data = JSON.parse(text); } catch { data = text; }
  }
  if (!res.ok) {
    const message = (data && data.message) || `${res.status} ${res.statusText}`;
    throw new ApiError(res.status, message);
  }
  return { data, headers: res.headers, status: res.status };
}

export const get = (path, query) => api("GET", path, { query });
export const post = (path, body) => api("POST", path, { body: body ?? {} });
export const del = (path) => api("DELETE", path);

/** The 8 hex digits a node puts in clientID (a SHA-256 of its id); null where the browser
 * has no WebCrypto (a page not served from localhost or over https). */
export async function clientIdOf(nodeId) {
  if (!globalThis.crypto?.subtle) return null;
  const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(nodeId));
  return [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, "0")).join("").slice(0, 8);
}
