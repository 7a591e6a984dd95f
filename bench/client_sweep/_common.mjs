// What the sweep's Node scripts share: the Node twin of _common.py (the same environment, records and classification;
// read that file's docstring). bench/client_sweep.py copies the .mjs files into the npm packages' folder and runs them
// there, since ESM resolves packages from the script's own folder. Nothing is retried.

export const URL = process.env.SWEEP_URL.replace(/\/$/, "");
export const BASE = URL.replace(/\/v1$/, "");
export const KEY = process.env.SWEEP_API_KEY;
export const MODEL = process.env.SWEEP_MODEL;
export const WEATHER_PROMPT = "What is the weather in Paris right now? Use the get_weather tool.";

/** The library parsed the server's answer, but the model's output did not satisfy it. */
export class ModelSide extends Error {}
/** The server's answer was wrong in a way the script itself checked. */
export class ServerSide extends Error {}

const METRIC = /^loopwise_requests_total\{endpoint="([^"]*)",status="(\d+)"\}\s+([0-9.e+]+)/gm;
const MODEL_SIDE = [
  "NoObjectGeneratedError",
  "InvalidToolInputError",
  "NoSuchToolError",
  "ZodError",
  "LengthFinishReasonError",
  "SyntaxError",
];
const TRANSPORT = ["APIConnectionError", "APIConnectionTimeoutError", "ECONNREFUSED", "ECONNRESET", "fetch failed", "AbortError"];

const BUSY = /^loopwise_(?:running_requests|queue_depth)\s+([0-9.e+]+)/gm;

async function statuses(text) {
  text ??= await (await fetch(BASE + "/metrics")).text();
  const out = {};
  for (const [, endpoint, status, n] of text.matchAll(METRIC)) {
    if (endpoint !== "/metrics") out[`${endpoint} ${status}`] = Math.round(Number(n));
  }
  return out;
}

// statuses() once the server has nothing in flight: a request is counted when its answer has been sent, and a stream
// the library gave up on mid-way is still being answered for a while (up to limitMs)
async function settled(limitMs = 30000) {
  const deadline = performance.now() + limitMs;
  let last = null;
  for (;;) {
    await new Promise((r) => setTimeout(r, 100));
    const text = await (await fetch(BASE + "/metrics")).text();
    const now = await statuses(text);
    const idle = ![...text.matchAll(BUSY)].some(([, v]) => Number(v) > 0);
    if ((idle && JSON.stringify(now) === JSON.stringify(last)) || performance.now() > deadline) return now;
    last = now;
  }
}

function diff(before, after) {
  const out = {};
  for (const k of Object.keys(after).sort()) if (after[k] - (before[k] ?? 0) > 0) out[k] = after[k] - (before[k] ?? 0);
  return out;
}

function chain(err) {
  const seen = [];
  const todo = [err];
  while (todo.length && seen.length < 20) {
    const e = todo.pop();
    if (e == null || typeof e !== "object" || seen.includes(e)) continue;
    seen.push(e);
    todo.push(e.cause, e.lastError, ...(Array.isArray(e.errors) ? e.errors : []));
  }
  return seen;
}

// openai's error classes keep name "Error": their constructor's name says which
const nameOf = (e) => (e.constructor?.name && e.constructor.name !== "Error" ? e.constructor.name : `${e.name ?? "Error"}`);

export function classify(err, http) {
  if (err instanceof ModelSide) return ["model-fail", "checked by the script"];
  if (err instanceof ServerSide) return ["server-fail", "checked by the script"];
  const bad = Object.keys(http).filter((k) => Number(k.split(" ").pop()) >= 400);
  if (bad.length && bad.every((k) => k.endsWith(" 400")) && `${err?.message}`.includes("maximum context length"))
    return ["model-fail", "HTTP 400: the prompt outgrew the model's context window (the model's limit, filled by its own output)"];
  if (bad.length) return ["server-fail", "HTTP " + bad.join(", ")];
  const errs = chain(err);
  for (const e of errs) {
    const code = [e.status, e.statusCode].find((v) => Number.isInteger(v) && v >= 400 && v < 600);
    if (code) return ["server-fail", `HTTP ${code} in ${nameOf(e)}`];
  }
  const names = errs.map((e) => `${nameOf(e)}: ${e.message ?? ""}`);
  if (names.some((n) => TRANSPORT.some((t) => n.includes(t)))) return ["server-fail", "transport: " + errs.map(nameOf).join(" <- ")];
  // the error the library raised (under a RetryError): a TypeValidationError of its own is the SDK failing to read
  // the server's answer (a protocol error); one under NoObjectGeneratedError is the model's output
  const top = errs.find((e) => !nameOf(e).includes("RetryError")) ?? errs[0];
  if (MODEL_SIDE.some((m) => nameOf(top).includes(m))) return ["model-fail", "output rejected: " + errs.map(nameOf).join(" <- ")];
  return ["server-fail", "unrecognised error: " + errs.map(nameOf).join(" <- ")];
}

export function short(value, n = 160) {
  let text = typeof value === "string" ? value : JSON.stringify(value) ?? String(value);
  text = text.split(/\s+/).join(" ").trim();
  return text.length <= n ? text : text.slice(0, n - 1) + "…";
}

async function versionOf(pkg) {
  try {
    const { readFile } = await import("node:fs/promises");
    return JSON.parse(await readFile(new globalThis.URL(`./node_modules/${pkg}/package.json`, import.meta.url), "utf8")).version;
  } catch {
    return "not installed";
  }
}

/** The header line, then each [name, fn] call once, in order; each prints its record as it ends. */
export async function main(library, packages, calls) {
  const versions = {};
  for (const p of packages) versions[p] = await versionOf(p);
  console.log(JSON.stringify({ library, versions, node: process.version, calls: calls.map(([name]) => name) }));
  for (const [name, fn] of calls) {
    const before = await statuses();
    const t0 = performance.now();
    const record = { call: name };
    let error = null;
    try {
      record.detail = short(await fn());
      record.status = "pass";
    } catch (err) {
      error = err;
      record.error = short(`${nameOf(err)}: ${err?.message ?? err}`, 600);
      record.trace = short(chain(err).map((e) => `${nameOf(e)}: ${e.message ?? ""}`).join(" <- "), 1200);
    }
    record.seconds = Math.round(performance.now() - t0) / 1000;
    record.http = diff(before, await settled());
    if (error !== null) [record.status, record.basis] = classify(error, record.http);
    console.log(JSON.stringify(record));
  }
}
