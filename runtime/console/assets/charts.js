// loopwise charts and panels: plain DOM + SVG, no dependencies, no build step.
// Shared by the console page (GET /console) and the standalone report (python -m learner report), so
// both draw the same learner and experiment views. Every piece of data is inserted as text (textContent
// or SVG text nodes), never as HTML: recorded messages are untrusted.
"use strict";

(function (root) {
  const SVG = "http://www.w3.org/2000/svg";

  // ---- small helpers ------------------------------------------------------------------------------
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "text") node.textContent = String(v);
      else if (k === "class") node.className = v;
      else if (k === "dataset") Object.assign(node.dataset, v);
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === undefined || c === null || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v !== undefined && v !== null) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  // A finite number, or null (status fields may be missing, null, strings: read defensively).
  function num(x) {
    return typeof x === "number" && Number.isFinite(x) ? x : null;
  }

  function fmt(x, digits) {
    const v = num(x);
    if (v === null) return "–";
    if (digits !== undefined) return v.toFixed(digits);
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
    if (Number.isInteger(v)) return String(v);
    return a >= 100 ? v.toFixed(1) : a >= 1 ? v.toFixed(3) : v.toPrecision(3);
  }

  function fmtP(p) {
    const v = num(p);
    if (v === null) return "–";
    return v < 1e-4 ? v.toExponential(1) : v.toFixed(4);
  }

  function fmtTime(t) {
    const v = num(t);
    if (v === null) return "–";
    const d = new Date(v * 1000);
    return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
  }

  function fmtDateTime(t) {
    const v = num(t);
    if (v === null) return "–";
    const d = new Date(v * 1000);
    return d.toLocaleDateString([], { month: "short", day: "numeric" }) + " " + fmtTime(v);
  }

  function fmtAgo(t, now) {
    const v = num(t);
    if (v === null) return "–";
    const s = Math.max(0, (now || Date.now() / 1000) - v);
    if (s < 60) return Math.round(s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    return (s / 3600).toFixed(1) + " h ago";
  }

  function badge(text, kind) {
    return el("span", { class: "badge " + (kind || String(text).replace(/[^a-z_]/gi, "")), text: text });
  }

  function kv(pairs) {
    const dl = el("dl", { class: "kv" });
    for (const [k, v] of pairs) {
      if (v === undefined) continue;
      dl.append(el("dt", { text: k }), el("dd", {}, v instanceof Node ? v : String(v)));
    }
    return dl;
  }

  function table(headers, rows, props) {
    const t = el("table", props || {});
    t.append(el("thead", {}, el("tr", {}, headers.map((h) => el("th", { text: h })))));
    const body = el("tbody");
    for (const r of rows) body.append(r instanceof Node ? r : el("tr", {}, r.map((c) => el("td", {}, c instanceof Node ? c : String(c)))));
    t.append(body);
    return el("div", { class: "table-wrap" }, t);
  }

  // ---- scales -------------------------------------------------------------------------------------
  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const span = hi - lo;
    const step0 = Math.pow(10, Math.floor(Math.log10(span / count)));
    const err = span / count / step0;
    const step = step0 * (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1);
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
    return ticks;
  }

  // Ticks on a time axis (unix seconds): a round step (10 s ... 1 day) giving at most ``count`` ticks.
  function timeTicks(lo, hi, count) {
    const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
    const step = steps.find((s) => (hi - lo) / s <= count) || 86400 * Math.ceil((hi - lo) / 86400 / count);
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi; v += step) ticks.push(v);
    return { ticks, step };
  }

  function tickFmt(v) {
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(0);
    return String(Number(v.toPrecision(4)));
  }

  function timeFmt(v, step) {
    const d = new Date(v * 1000);
    const opts = step < 60 ? { hour: "2-digit", minute: "2-digit", second: "2-digit" } : { hour: "2-digit", minute: "2-digit" };
    return d.toLocaleTimeString([], opts);
  }

  // ---- line chart ---------------------------------------------------------------------------------
  // opts: {series: [{name, points: [[x, y], ...], step?, dashed?, markers?}], title, xTime, yLog, yMin, yMax,
  //        xMin, xMax, hlines: [{y, label}], height, yLabel, xLabel, empty}
  function lineChart(opts) {
    const wrap = el("figure", { class: "chart" });
    if (opts.title) wrap.append(el("figcaption", { text: opts.title }));
    const series = (opts.series || []).map((s) => ({ ...s, points: (s.points || []).filter((p) => num(p[0]) !== null && num(p[1]) !== null && (!opts.yLog || p[1] > 0)) }));
    const all = series.flatMap((s) => s.points);
    if (!all.length) {
      wrap.append(el("p", { class: "empty", text: opts.empty || "no data yet" }));
      return wrap;
    }
    const W = Math.max(280, Math.min(opts.width || 640, 1200));
    const H = opts.height || 200;
    const m = { l: 52, r: 12, t: 8, b: 26 };
    const xs = all.map((p) => p[0]);
    let x0 = num(opts.xMin) ?? Math.min(...xs);
    let x1 = num(opts.xMax) ?? Math.max(...xs);
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    const ys = all.map((p) => p[1]).concat((opts.hlines || []).map((h) => h.y));
    let y0 = num(opts.yMin) ?? Math.min(...ys);
    let y1 = num(opts.yMax) ?? Math.max(...ys);
    const tf = opts.yLog ? (v) => Math.log10(v) : (v) => v;
    if (opts.yLog) { y0 = Math.min(y0, 1); }
    let ly0 = tf(y0), ly1 = tf(y1);
    if (ly1 === ly0) { ly0 -= opts.yLog ? 1 : Math.abs(ly0) * 0.1 + 1; ly1 += opts.yLog ? 0.1 : Math.abs(ly1) * 0.1 + 1; }
    if (!opts.yLog && num(opts.yMin) === null) { const pad = (ly1 - ly0) * 0.06; ly0 -= pad; ly1 += pad; }
    const X = (v) => m.l + ((v - x0) / (x1 - x0)) * (W - m.l - m.r);
    const Y = (v) => H - m.b - ((tf(v) - ly0) / (ly1 - ly0)) * (H - m.t - m.b);
    const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "plot", role: "img" });
    if (opts.title) g.append(svg("title", {}, opts.title));
    // axes and grid
    const yt = opts.yLog ? niceTicks(Math.floor(ly0), Math.ceil(ly1), 5).filter((v) => Number.isInteger(v)).map((v) => Math.pow(10, v)) : niceTicks(ly0, ly1, 5);
    for (const v of yt) {
      const y = Y(v);
      if (y < m.t - 1 || y > H - m.b + 1) continue;
      g.append(svg("line", { x1: m.l, x2: W - m.r, y1: y, y2: y, class: "grid" }));
      g.append(svg("text", { x: m.l - 6, y: y + 4, class: "tick", "text-anchor": "end" }, tickFmt(v)));
    }
    const xCount = Math.max(2, Math.floor(W / 90));
    const xt = opts.xTime ? timeTicks(x0, x1, xCount) : { ticks: niceTicks(x0, x1, xCount).filter((v) => !opts.xInteger || Number.isInteger(v)) };
    for (const v of xt.ticks) {
      const x = X(v);
      g.append(svg("line", { x1: x, x2: x, y1: H - m.b, y2: H - m.b + 4, class: "axis" }));
      g.append(svg("text", { x: x, y: H - 8, class: "tick", "text-anchor": "middle" }, opts.xTime ? timeFmt(v, xt.step) : tickFmt(v)));
    }
    g.append(svg("line", { x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, class: "axis" }));
    g.append(svg("line", { x1: m.l, x2: m.l, y1: m.t, y2: H - m.b, class: "axis" }));
    for (const h of opts.hlines || []) {
      const y = Y(h.y);
      g.append(svg("line", { x1: m.l, x2: W - m.r, y1: y, y2: y, class: "hline" }));
      if (h.label) g.append(svg("text", { x: W - m.r - 2, y: y - 3, class: "tick", "text-anchor": "end" }, h.label));
    }
    series.forEach((s, i) => {
      const cls = "s" + (s.color !== undefined ? s.color : i) % 8;
      const pts = s.points.slice().sort((a, b) => a[0] - b[0]);
      let d = "";
      pts.forEach((p, k) => {
        const x = X(p[0]), y = Y(p[1]);
        if (k === 0) d += `M${x.toFixed(1)},${y.toFixed(1)}`;
        else if (s.step) d += `H${x.toFixed(1)}V${y.toFixed(1)}`;
        else d += `L${x.toFixed(1)},${y.toFixed(1)}`;
      });
      if (s.extendTo !== undefined && pts.length) d += `H${X(s.extendTo).toFixed(1)}`;
      g.append(svg("path", { d, class: "line " + cls + (s.dashed ? " dashed" : "") }));
      if (s.markers || pts.length <= 1) {
        for (const p of pts) {
          const c = svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 3, class: "dot " + cls });
          c.append(svg("title", {}, `${s.name}: ${opts.xTime ? fmtTime(p[0]) : fmt(p[0])} → ${opts.yLog ? fmtP(p[1]) : fmt(p[1])}`));
          g.append(c);
        }
      }
    });
    wrap.append(g);
    if (series.length > 1 || opts.legend) {
      const legend = el("div", { class: "legend" });
      series.forEach((s, i) => legend.append(el("span", { class: "key s" + (s.color !== undefined ? s.color : i) % 8 + (s.dashed ? " dashed" : "") }, s.name)));
      wrap.append(legend);
    }
    return wrap;
  }

  // ---- means with confidence intervals (one row per arm) ------------------------------------------
  function ciChart(rows, opts) {
    opts = opts || {};
    const wrap = el("figure", { class: "chart" });
    if (opts.title) wrap.append(el("figcaption", { text: opts.title }));
    const ok = rows.filter((r) => num(r.mean) !== null);
    if (!ok.length) {
      wrap.append(el("p", { class: "empty", text: opts.empty || "no rewards yet" }));
      return wrap;
    }
    const W = Math.max(280, Math.min(opts.width || 640, 1200));
    const rowH = 30;
    const m = { l: 120, r: 70, t: 6, b: 24 };
    const H = m.t + m.b + rowH * rows.length;
    const vals = ok.flatMap((r) => [r.mean, num(r.low) ?? r.mean, num(r.high) ?? r.mean]);
    let lo = Math.min(...vals, num(opts.min) ?? Infinity), hi = Math.max(...vals, num(opts.max) ?? -Infinity);
    if (hi === lo) { lo -= 0.5; hi += 0.5; }
    const X = (v) => m.l + ((v - lo) / (hi - lo)) * (W - m.l - m.r);
    const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "plot", role: "img" });
    for (const v of niceTicks(lo, hi, 5)) {
      g.append(svg("line", { x1: X(v), x2: X(v), y1: m.t, y2: H - m.b, class: "grid" }));
      g.append(svg("text", { x: X(v), y: H - 8, class: "tick", "text-anchor": "middle" }, tickFmt(v)));
    }
    rows.forEach((r, i) => {
      const y = m.t + rowH * i + rowH / 2;
      const cls = "s" + (r.color !== undefined ? r.color : i) % 8 + (r.muted ? " muted" : "");
      g.append(svg("text", { x: m.l - 8, y: y + 4, class: "label", "text-anchor": "end" }, r.label));
      if (num(r.mean) === null) {
        g.append(svg("text", { x: m.l + 4, y: y + 4, class: "tick" }, "no rewards"));
        return;
      }
      const low = num(r.low), high = num(r.high);
      if (low !== null && high !== null) {
        g.append(svg("line", { x1: X(low), x2: X(high), y1: y, y2: y, class: "ci " + cls }));
        g.append(svg("line", { x1: X(low), x2: X(low), y1: y - 6, y2: y + 6, class: "ci " + cls }));
        g.append(svg("line", { x1: X(high), x2: X(high), y1: y - 6, y2: y + 6, class: "ci " + cls }));
      }
      const c = svg("circle", { cx: X(r.mean), cy: y, r: 5, class: "dot " + cls });
      c.append(svg("title", {}, `${r.label}: mean ${fmt(r.mean)} [${fmt(low)}, ${fmt(high)}], n=${r.n}`));
      g.append(c);
      g.append(svg("text", { x: W - m.r + 6, y: y + 4, class: "tick" }, `n=${r.n}`));
    });
    wrap.append(g);
    return wrap;
  }

  // Grid layout for charts: how many columns of at least ``min`` px fit in ``width`` (at most ``max``), and each one's width.
  function columns(width, min, max) {
    return Math.max(1, Math.min(max, Math.floor(((width || 640) + 16) / (min + 16))));
  }

  function cellWidth(width, cols) {
    return Math.floor(((width || 640) - 16 * (cols - 1)) / cols);
  }

  // ---- the learner view -----------------------------------------------------------------------------
  const LAST_METRICS = [
    ["loss", "loss"],
    ["kl", "KL"],
    ["clip_frac", "clip fraction"],
    ["entropy", "entropy"],
    ["frac_reward_zero_std", "zero-variance fraction"],
    ["reward_mean", "reward mean"],
    ["reward_std", "reward std"],
    ["samples", "samples"],
    ["trained_samples", "trained samples"],
    ["tokens", "tokens"],
    ["grad_norm", "grad norm"],
    ["step_s", "step seconds"],
    ["tokens_per_s", "tokens/s"],
  ];

  // Why the last update did or did not train, in words, from whatever the status and history say.
  function learnerWhy(st) {
    const hist = Array.isArray(st.history) ? st.history : [];
    const last = hist.length ? hist[hist.length - 1] : null;
    const out = [];
    if (st.detail) out.push(`now: ${st.state || "?"}: ${st.detail}`);
    if (last) {
      const m = last.metrics || {};
      const gate = last.gate || {};
      if (last.held) out.push(`version ${last.version}: published after its experiment decided`);
      else if (m.optimizer_step === true) out.push(`last update (version ${last.version}): trained on ${m.trained_samples ?? "?"} of ${m.samples ?? "?"} samples`);
      else if (m.optimizer_step === false) out.push(`last update (version ${last.version}): no optimizer step, ${m.samples ?? 0} samples`);
      if (num(m.frac_reward_zero_std) !== null && m.frac_reward_zero_std > 0) out.push(`${Math.round(m.frac_reward_zero_std * 100)}% of groups had equal rewards (nothing to learn from)`);
      const skipped = m.skipped && typeof m.skipped === "object" ? Object.entries(m.skipped).filter(([, n]) => num(n)) : [];
      if (skipped.length) out.push("skipped: " + skipped.map(([k, n]) => `${k.replace(/_/g, " ")} ${n}`).join(", "));
      const unused = last.unused && typeof last.unused === "object" ? last.unused : null;
      if (unused && unused.top) out.push(`top reason data went unused: ${unused.top}`);
      if (gate.parity && num(gate.parity.mean_abs_logp_diff) !== null) out.push(`logprob parity: ${fmt(gate.parity.mean_abs_logp_diff, 4)} nats/token`);
      if (gate.decision) out.push(`gate: ${gate.decision}${gate.reason ? " (" + gate.reason + ")" : ""}` + (num(gate.new_success) !== null ? `: held-out ${fmt(gate.new_success, 2)} vs ${gate.champion || "champion"} ${fmt(gate.champion_success, 2)}` : ""));
    }
    if (!out.length) out.push("no update yet");
    return out;
  }

  // What crashed, how often, and what was quarantined (serve.py's supervisor.json, the learner's last_error and
  // quarantine: learner/supervisor.py, learner/quarantine.py); null while none of it has happened.
  function learnerHealth(st) {
    const obj = (v) => (v && typeof v === "object" ? v : null);
    const sup = obj(st.supervisor);
    const err = obj(st.last_error);
    const q = obj(st.quarantine) || {};
    const fb = obj(st.failing_batch);
    const restarted = sup && (num(sup.restarts) > 0 || (sup.state && sup.state !== "running" && sup.state !== "stopped"));
    if (!err && !(num(q.trajectories) > 0) && !fb && !restarted && !(num(st.crashes) > 0)) return null;
    const box = el("div", { class: "health", dataset: { testid: "learner-health" } }, el("h4", { text: "crashes and quarantine" }));
    const rows = [];
    if (sup) {
      const next = sup.state === "backoff" && num(sup.next_restart_at) !== null ? `; next restart in ${Math.max(0, Math.round(sup.next_restart_at - Date.now() / 1000))} s` : "";
      rows.push(["restarts", `${sup.restarts ?? 0}${next}`]);
      if (num(sup.last_exit_at) !== null) rows.push(["last exit", `${sup.last_exit_signal || "exit code " + sup.last_exit_code}, ${fmtAgo(sup.last_exit_at)} (after ${fmt(sup.last_ran_s, 1)} s)`]);
      if (sup.state === "failed") rows.push(["supervisor", "not restarted: the learner refused its configuration"]);
    }
    rows.push(["crashes", st.crashes ?? 0]);
    if (fb) rows.push(["failing batch", `${fb.failures} failure(s), ${fb.suspects} suspect trajectories: retried, quarantined at the next failure`]);
    rows.push(["quarantined", `${q.trajectories || 0} trajectories in ${q.batches || 0} batches`]);
    box.append(kv(rows));
    if (err) {
      box.append(el("p", { class: "error-line", dataset: { testid: "learner-error" }, text: `last error (${fmtAgo(err.at)}): ${err.type}: ${err.message}` }));
      if (Array.isArray(err.traceback) && err.traceback.length) box.append(el("pre", { class: "traceback", text: err.traceback.join("\n") }));
    }
    const recent = Array.isArray(q.recent) ? q.recent : [];
    if (recent.length) {
      const items = recent.map((b) => {
        const ids = Array.isArray(b.trajectory_ids) ? b.trajectory_ids : [];
        const shown = ids.slice(0, 10).join(", ") + (ids.length > 10 ? ` and ${ids.length - 10} more` : "");
        return el("li", { text: `${fmtDateTime(b.at)}: ${ids.length} trajectories (${shown}): ${b.reason || "?"}` });
      });
      box.append(el("ul", { class: "why", dataset: { testid: "learner-quarantine" } }, items));
    }
    return box;
  }

  function learnerPanel(st, opts) {
    opts = opts || {};
    const hist = Array.isArray(st.history) ? st.history : [];
    const panel = el("section", { class: "panel learner", dataset: { testid: "learner", family: st.family || "" } });
    const head = el("header", { class: "panel-head" }, el("h3", { text: `learner · ${st.family || "?"}` }), badge(st.state || "unknown"));
    if (st.running === false) head.append(badge("not running", "stopped"));
    const supState = st.supervisor && st.supervisor.state;
    if (supState === "backoff") head.append(badge("restarting", "error"));
    else if (supState === "failed") head.append(badge("not restarted", "error"));
    if (opts.actions) head.append(opts.actions);
    panel.append(head);
    panel.append(kv([
      ["version", st.version ?? "–"],
      ["champion", st.champion || "–"],
      ["experiment", st.experiment || "–"],
      ["updates", st.updates ?? "–"],
      ["new trajectories", st.new_trajectories ?? "–"],
      ["last update", st.last_update_at ? fmtAgo(st.last_update_at) : "–"],
    ]));
    panel.append(el("ul", { class: "why", dataset: { testid: "learner-why" } }, learnerWhy(st).map((t) => el("li", { text: t }))));
    const health = learnerHealth(st);
    if (health) panel.append(health);
    const trained = hist.filter((h) => h && h.metrics && Object.keys(h.metrics).length);
    const gated = hist.filter((h) => h && h.gate && num(h.gate.new_success) !== null);
    const width = opts.width;
    panel.append(lineChart({
      title: "reward per update",
      width,
      series: [
        { name: "train reward (mean)", points: trained.map((h) => [h.version, num(h.metrics.reward_mean)]), markers: true },
        { name: "held-out success (new version)", points: gated.map((h) => [h.version, h.gate.new_success]), markers: true, color: 1 },
        { name: "held-out success (champion)", points: gated.map((h) => [h.version, num(h.gate.champion_success)]), markers: true, dashed: true, color: 2 },
      ],
      xLabel: "version",
      xInteger: true,
      legend: true,
      empty: "no update yet",
    }));
    const cols = columns(width, 200, 5);
    const small = el("div", { class: "grid cols-" + cols });
    for (const [k, label] of [["loss", "loss"], ["kl", "KL"], ["clip_frac", "clip fraction"], ["entropy", "entropy"], ["frac_reward_zero_std", "zero-variance fraction"]]) {
      small.append(lineChart({ title: label, height: 130, width: cellWidth(width, cols), xInteger: true, series: [{ name: label, points: trained.map((h) => [h.version, num(h.metrics[k])]), markers: true }] }));
    }
    panel.append(small);
    const lastTrained = trained.length ? trained[trained.length - 1].metrics : {};
    const lm = st.last_metrics && typeof st.last_metrics === "object" && Object.keys(st.last_metrics).length ? st.last_metrics : lastTrained;
    const known = new Set(LAST_METRICS.map(([k]) => k));
    const rows = LAST_METRICS.filter(([k]) => k in lm).map(([k, label]) => [label, fmt(lm[k])]);
    // anything else the learner reports (its status grows): shown as it is
    for (const [k, v] of Object.entries(lm)) if (!known.has(k) && num(v) !== null) rows.push([k.replace(/_/g, " "), fmt(v)]);
    const metrics = kv(rows);
    metrics.dataset.testid = "learner-metrics";
    panel.append(el("h4", { text: "last update" }), rows.length ? metrics : el("p", { class: "empty", text: "no update yet" }));
    return panel;
  }

  // ---- the experiment view --------------------------------------------------------------------------
  function experimentPanel(ex, opts) {
    opts = opts || {};
    const cfg = ex.config || {};
    const arms = Array.isArray(ex.arms) ? ex.arms : [];
    const panel = el("section", { class: "panel experiment", dataset: { testid: "experiment", name: ex.name || "" } });
    const head = el("header", { class: "panel-head" }, el("h3", { text: `experiment · ${ex.name}` }), badge(ex.status || "unknown"));
    if (opts.actions) head.append(opts.actions);
    panel.append(head);
    const decisions = Array.isArray(ex.decisions) ? ex.decisions : [];
    const final = decisions.filter((d) => d.action !== "rollback").slice(-1)[0];
    panel.append(kv([
      ["family", cfg.family || "–"],
      ["champion", ex.champion || "–"],
      ["winner", ex.winner || (ex.status === "running" ? "undecided" : "–")],
      ["metric", cfg.metric || (Array.isArray(cfg.reward_sources) ? `best-ranked of ${cfg.reward_sources.join(", ")}` : cfg.sources === "any" ? "any reward" : "verifier:* and judge:*")],
      ["evidence", ex.evidence || "–"],
      ["samples per arm", `min ${cfg.min_samples ?? "–"}` + (cfg.max_samples ? `, max ${cfg.max_samples}` : "") + (cfg.max_duration_s ? `; ends undecided after ${cfg.max_duration_s} s` : "")],
      ["alpha", cfg.alpha ?? "–"],
      ["started", fmtDateTime(ex.started_at)],
      ["decided", final ? `${final.action} at ${fmtDateTime(final.time)}` : "–"],
    ]));
    panel.append(ciChart(arms.map((a, i) => ({
      label: a.adapter + (a.champion ? " ★" : ""), mean: a.mean_reward, low: a.ci95 ? a.ci95[0] : null, high: a.ci95 ? a.ci95[1] : null, n: a.n, color: i, muted: a.stopped,
    })), { title: "mean reward per arm, 95% CI", width: opts.width }));
    const rows = arms.map((a) => {
      const tr = el("tr", { dataset: { testid: "arm-row", adapter: a.adapter } });
      const cells = [
        a.adapter + (a.champion ? " (champion)" : "") + (a.stopped ? " (rolled back)" : ""),
        fmt(a.weight), String(a.n ?? "–"), fmt(a.mean_reward, 3),
        a.ci95 ? `[${fmt(a.ci95[0], 3)}, ${fmt(a.ci95[1], 3)}]` : "–",
        String(a.requests ?? "–"), fmt(a.mean_latency_s, 2), fmt(a.tokens_per_s, 1),
        a.champion ? "–" : fmtP(a.msprt_p_value), a.champion ? "–" : fmtP(a.welch_p_fixed_horizon),
      ];
      const names = ["arm", "weight", "n", "mean", "ci95", "requests", "latency", "tps", "p", "welch"];
      cells.forEach((c, i) => tr.append(el("td", { dataset: { col: names[i] }, text: c })));
      if (opts.armActions) tr.append(el("td", {}, opts.armActions(a)));
      return tr;
    });
    const headers = ["arm", "weight", "n", "mean reward", "95% CI", "requests", "latency s", "tokens/s", "always-valid p", "Welch p (fixed horizon)"];
    if (opts.armActions) headers.push("");
    panel.append(table(headers, rows, { class: "arms" }));
    const ph = ex.p_history && typeof ex.p_history === "object" ? ex.p_history : {};
    const end = ex.status === "running" ? (num(opts.now) ?? Date.now() / 1000) : (final ? final.time : null);
    const series = arms.filter((a) => !a.champion).map((a) => {
      const pts = (Array.isArray(ph[a.adapter]) ? ph[a.adapter] : []).map((h) => [h.t, h.p]);
      return { name: `${a.adapter} vs ${ex.champion}`, points: pts, step: true, markers: true, extendTo: end ?? undefined, color: arms.indexOf(a) };
    });
    panel.append(lineChart({
      title: "always-valid p-value over time", series, xTime: true, yLog: true, yMax: 1, xMax: end ?? undefined,
      hlines: [{ y: num(cfg.alpha) ?? 0.05, label: `alpha ${cfg.alpha ?? 0.05}` }], legend: true, width: opts.width,
      empty: `no p-value yet (computed once both arms have ${cfg.min_samples ?? "min_samples"} rewards)`,
    }));
    if (decisions.length) {
      panel.append(el("h4", { text: "decisions" }));
      panel.append(el("ul", { class: "decisions" }, decisions.map((d) => el("li", {}, el("b", { text: d.action }), ` ${d.arm || ""} · ${fmtDateTime(d.time)} · ${d.reason || ""}`))));
    }
    return panel;
  }

  root.LW = { el, svg, num, fmt, fmtP, fmtTime, fmtDateTime, fmtAgo, badge, kv, table, niceTicks, columns, cellWidth, lineChart, ciChart, learnerPanel, learnerWhy, learnerHealth, experimentPanel };
})(window);
