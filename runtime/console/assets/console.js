// The loopwise console: one page over the admin API's JSON (no private endpoints, no copy of the data).
// The admin key is asked for once and kept in sessionStorage (gone when the tab closes); a URL of the
// form /console#key=... (printed by serve.py) hands it over without typing. Views: overview (models,
// families, versions, aliases, traffic share), experiments, learners, traffic, trajectories. Actions ask
// for confirmation first. Everything refreshes every few seconds while the tab is visible.
"use strict";

(function () {
  const { el, num, fmt, fmtTime, fmtDateTime, fmtAgo, badge, kv, table, columns, cellWidth, lineChart, learnerPanel, experimentPanel } = window.LW;
  const KEY = "loopwise.adminKey";
  const REFRESH_MS = 5000;
  const VIEWS = ["overview", "experiments", "learners", "traffic", "trajectories"];
  const state = { view: "overview", timer: null, busy: false, details: new Map(), rewardedOnly: false, openTrajectory: null, lastOk: null };

  const $ = (sel) => document.querySelector(sel);

  // ---- the admin API ------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, message, code) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  async function api(path, options) {
    const key = sessionStorage.getItem(KEY);
    if (!key) throw new ApiError(401, "no admin key");
    const init = { method: "GET", ...(options || {}), headers: { Authorization: "Bearer " + key } };
    if (init.body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(init.body);
    }
    const r = await fetch(path, init);
    let body = null;
    try {
      body = await r.json();
    } catch (e) {
      body = null;
    }
    if (!r.ok) {
      const err = body && body.error ? body.error : {};
      throw new ApiError(r.status, err.message || `HTTP ${r.status}`, err.code);
    }
    return body;
  }

  // A view's data: its failures are shown in place, and only an auth failure takes the page back to the key prompt.
  async function optional(path, fallback) {
    try {
      return await api(path);
    } catch (e) {
      if (e.status === 401 || e.status === 403) throw e;
      return { __error: e.message, ...(fallback || {}) };
    }
  }

  // ---- key prompt ---------------------------------------------------------------------------------
  function showLogin(message) {
    stopPolling();
    document.body.classList.add("locked");
    $("#login").hidden = false;
    $("#app").hidden = true;
    $("#login-error").textContent = message || "";
    $("#key").focus();
  }

  function showApp() {
    document.body.classList.remove("locked");
    $("#login").hidden = true;
    $("#app").hidden = false;
  }

  function authFailed(e) {
    sessionStorage.removeItem(KEY);
    for (const id of VIEWS) $("#view-" + id).replaceChildren();
    const msg = e.status === 403 ? `The admin API refused: ${e.message}` : "That admin key was not accepted.";
    showLogin(msg);
  }

  // ---- confirmation and actions -------------------------------------------------------------------
  function confirmAction(message) {
    const dlg = $("#confirm");
    $("#confirm-text").textContent = message;
    return new Promise((resolve) => {
      const done = (ok) => {
        dlg.close();
        $("#confirm-ok").removeEventListener("click", yes);
        $("#confirm-cancel").removeEventListener("click", no);
        dlg.removeEventListener("cancel", no);
        resolve(ok);
      };
      const yes = () => done(true);
      const no = (ev) => {
        if (ev) ev.preventDefault();
        done(false);
      };
      $("#confirm-ok").addEventListener("click", yes);
      $("#confirm-cancel").addEventListener("click", no);
      dlg.addEventListener("cancel", no);
      dlg.showModal();
    });
  }

  function toast(text, kind) {
    const t = el("div", { class: "toast " + (kind || ""), role: "status", text });
    $("#toasts").append(t);
    setTimeout(() => t.remove(), 6000);
  }

  async function act(message, path, options, done) {
    if (!(await confirmAction(message))) return;
    try {
      await api(path, options);
      toast(done || "done", "ok");
    } catch (e) {
      if (e.status === 401 || e.status === 403) return authFailed(e);
      toast(e.message, "error");
    }
    refresh();
  }

  function button(label, onclick, props) {
    return el("button", { type: "button", class: "action", onclick, ...(props || {}) }, label);
  }

  // ---- views --------------------------------------------------------------------------------------
  function errorNote(data) {
    return data && data.__error ? el("p", { class: "error", text: data.__error }) : null;
  }

  function width(id) {
    const w = $("#view-" + id).clientWidth;
    return w > 0 ? Math.min(w - 34, 1100) : 640;
  }

  function tile(label, value, testid) {
    return el("div", { class: "tile", dataset: { testid: testid || "" } }, el("div", { class: "tile-value", text: value }), el("div", { class: "tile-label", text: label }));
  }

  async function renderOverview(ready) {
    const [adapters, exps, traffic, learner] = await Promise.all([
      optional("/admin/adapters", { data: [], aliases: {} }),
      optional("/admin/experiments", { data: [] }),
      optional("/admin/traffic?minutes=5", { points: [], totals: {} }),
      optional("/admin/learner?history=0", { data: [] }),
    ]);
    const view = el("div");
    const totals = traffic.totals || {};
    const recent = (traffic.points || []).slice(-6).filter((p) => num(p.dt) > 0);
    const span = recent.reduce((s, p) => s + p.dt, 0);
    const rate = (k) => (span ? recent.reduce((s, p) => s + (num(p[k]) || 0) * p.dt, 0) / span : null);
    const withLatency = recent.filter((p) => num(p.latency_p95_s) !== null);
    const last = withLatency.length ? withLatency[withLatency.length - 1] : null;
    const errs = Object.values(totals.errors || {}).reduce((a, b) => a + b, 0);
    view.append(el("div", { class: "tiles" },
      tile("requests/s (last minute)", fmt(rate("requests_per_s"), 2), "tile-rps"),
      tile("tokens/s (last minute)", fmt(rate("tokens_per_s"), 1), "tile-tps"),
      tile("latency p95 (last minute)", last && num(last.latency_p95_s) !== null ? fmt(last.latency_p95_s, 2) + " s" : "–", "tile-p95"),
      tile("errors (5 min)", String(errs), "tile-errors"),
      tile("learners", String((learner.data || []).map((l) => `${l.family}: ${l.state}`).join(", ") || "none"), "tile-learners"),
    ));
    const share = totals.by_adapter || {};
    const aliases = adapters.aliases || {};
    const running = (exps.data || []).filter((e) => e.status === "running");
    const base = ready && ready.model ? ready.model : "base model";
    const rows = [];
    const shareText = (name) => (share[name] ? `${Math.round(share[name].share * 100)}%` : "0%");
    rows.push(el("tr", { dataset: { testid: "version-row", name: "base" } },
      el("td", { text: base }), el("td", { text: "base model" }), el("td", { text: "–" }), el("td", { text: "ready" }), el("td", { text: "–" }),
      el("td", { dataset: { col: "share" }, text: shareText("base") }), el("td")));
    const families = new Map();
    for (const a of adapters.data || []) {
      if (!families.has(a.family)) families.set(a.family, []);
      families.get(a.family).push(a);
    }
    for (const [family, versions] of [...families.entries()].sort()) {
      versions.sort((x, y) => (num(x.version) || 0) - (num(y.version) || 0));
      for (const a of versions) {
        const isTarget = aliases[family] === a.name;
        const acts = el("td", { class: "actions" });
        if (!isTarget && a.state !== "draining") {
          acts.append(button("make champion", () => act(`Point the alias ${family} at ${a.name}? Requests to ${family} are served by it from now on.`, `/admin/aliases/${encodeURIComponent(family)}`, { method: "PUT", body: { target: a.name } }, `${family} → ${a.name}`), { "data-testid": "set-alias" }));
          acts.append(button("unload", () => act(`Unload ${a.name}? It stops serving once its in-flight requests finish.`, `/admin/adapters/${encodeURIComponent(a.name)}`, { method: "DELETE" }, `${a.name} unloaded`), { class: "action danger", "data-testid": "unload" }));
        }
        rows.push(el("tr", { dataset: { testid: "version-row", name: a.name } },
          el("td", { dataset: { col: "name" }, text: a.name }),
          el("td", { text: family }),
          el("td", { dataset: { col: "aliases" }, text: (a.aliases || []).join(", ") || "–" }),
          el("td", {}, badge(a.state || "?"), a.pinned ? " pinned" : ""),
          el("td", { text: String(a.in_flight ?? "–") }),
          el("td", { dataset: { col: "share" }, text: shareText(a.name) }),
          acts));
      }
    }
    view.append(el("section", { class: "panel" },
      el("header", { class: "panel-head" }, el("h3", { text: "models and versions" })),
      errorNote(adapters),
      kv(Object.entries(aliases).map(([f, t]) => [`alias ${f}`, t]).concat([["served base", base]])),
      table(["version", "family", "aliases", "state", "in flight", "traffic share (5 min)", ""], rows, { class: "versions", "data-testid": "versions" })));
    if (running.length) {
      const list = el("ul");
      for (const e of running) list.append(el("li", {}, el("a", { href: "#experiments", text: e.name }), ` on ${e.family}: champion ${e.champion || "?"}, running since ${fmtAgo(e.started_at)}`));
      view.append(el("section", { class: "panel" }, el("header", { class: "panel-head" }, el("h3", { text: "running experiments" })), list,
        el("p", { class: "hint", text: "Requests to an alias under test are split between the arms by a hash of the session (weights in the experiment)." })));
    }
    return view;
  }

  async function renderExperiments() {
    const list = await optional("/admin/experiments", { data: [] });
    const view = el("div");
    if (list.__error) view.append(errorNote(list));
    const all = (list.data || []).slice().sort((a, b) => (num(b.started_at) || 0) - (num(a.started_at) || 0));
    if (!all.length) view.append(el("p", { class: "empty", text: "no experiments yet" }));
    // every running experiment and the five most recent ended ones in full; older ones as a list
    const full = all.filter((e) => e.status === "running").concat(all.filter((e) => e.status !== "running").slice(0, 5));
    const details = await Promise.all(full.map((e) => optional(`/admin/experiments/${encodeURIComponent(e.name)}`, { name: e.name })));
    for (const ex of details) {
      if (ex.__error) {
        view.append(el("section", { class: "panel" }, el("h3", { text: ex.name }), errorNote(ex)));
        continue;
      }
      const running = ex.status === "running";
      const actions = running ? el("span", { class: "actions" }, button("stop", () => act(`Stop experiment ${ex.name}? The champion ${ex.champion} keeps serving.`, `/admin/experiments/${encodeURIComponent(ex.name)}/stop`, { method: "POST" }, `${ex.name} stopped`), { class: "action danger", "data-testid": "stop" })) : null;
      const armActions = running ? (a) => (a.champion ? "" : button(`promote`, () => act(`Promote ${a.adapter}? The alias ${ex.config.family} will point at it and the experiment ends.`, `/admin/experiments/${encodeURIComponent(ex.name)}/promote`, { method: "POST", body: { arm: a.adapter } }, `${a.adapter} promoted`), { "data-testid": "promote" })) : null;
      view.append(experimentPanel(ex, { actions, armActions, width: width("experiments") }));
    }
    const rest = all.filter((e) => !full.includes(e));
    if (rest.length) {
      view.append(el("section", { class: "panel" }, el("h3", { text: "older experiments" }),
        table(["name", "family", "status", "champion", "winner", "started"], rest.map((e) => [e.name, e.family, e.status, e.champion || "–", e.winner || "–", fmtDateTime(e.started_at)]))));
    }
    return view;
  }

  async function renderLearners() {
    const data = await optional("/admin/learner?history=200", { data: [] });
    const view = el("div");
    if (data.__error) view.append(errorNote(data));
    if (data.enabled === false && !(data.data || []).length) view.append(el("p", { class: "empty", text: "no learner: this server runs with --no-learner (a learner on another host shows here once it writes its status)" }));
    else if (!(data.data || []).length) view.append(el("p", { class: "empty", text: "the learner has not reported yet" }));
    for (const st of data.data || []) {
      const actions = el("span", { class: "actions" }, button("request update", () => act(`Ask the ${st.family} learner for an update now (without waiting for enough new trajectories)?`, "/admin/learner/update", { method: "POST", body: { family: st.family } }, `update requested for ${st.family}`), { "data-testid": "request-update" }));
      view.append(learnerPanel(st, { actions, width: width("learners") }));
    }
    return view;
  }

  async function renderTraffic() {
    const t = await optional("/admin/traffic?minutes=60", { points: [], totals: {} });
    const view = el("div");
    if (t.__error) view.append(errorNote(t));
    const pts = (t.points || []).filter((p) => num(p.dt) > 0);
    const adapters = [...new Set(pts.flatMap((p) => Object.keys(p.by_adapter || {})))].sort();
    const cols = columns(width("traffic"), 420, 2);
    const w = cellWidth(width("traffic"), cols);
    const per = (k) => adapters.map((a, i) => ({ name: a, points: pts.map((p) => [p.t, p.by_adapter && p.by_adapter[a] ? num(p.by_adapter[a][k]) : 0]), color: i + 1 }));
    const grid = el("div", { class: "grid cols-" + cols });
    grid.append(lineChart({ title: "requests/s", xTime: true, yMin: 0, width: w, series: [{ name: "all", points: pts.map((p) => [p.t, p.requests_per_s]), color: 0 }, ...per("requests_per_s")], legend: true }));
    grid.append(lineChart({ title: "tokens/s (generated)", xTime: true, yMin: 0, width: w, series: [{ name: "all", points: pts.map((p) => [p.t, p.tokens_per_s]), color: 0 }, ...per("tokens_per_s")], legend: true }));
    grid.append(lineChart({ title: "latency (s)", xTime: true, yMin: 0, width: w, series: [
      { name: "p50", points: pts.map((p) => [p.t, num(p.latency_p50_s)]) },
      { name: "p95", points: pts.map((p) => [p.t, num(p.latency_p95_s)]), dashed: true },
    ], legend: true }));
    const codes = [...new Set(pts.flatMap((p) => Object.keys(p.errors || {})))].sort();
    grid.append(lineChart({ title: "errors per interval, by status", xTime: true, yMin: 0, width: w, series: codes.map((c, i) => ({ name: c, points: pts.map((p) => [p.t, (p.errors || {})[c] || 0]), color: i + 3 })), legend: true, empty: "no errors in the last hour" }));
    view.append(el("section", { class: "panel" }, el("header", { class: "panel-head" }, el("h3", { text: "traffic, last hour" }), el("span", { class: "hint", text: `one point per ${t.interval_s || "?"} s` })), grid));
    const totals = t.totals || {};
    const by = totals.by_adapter || {};
    view.append(el("section", { class: "panel" }, el("h3", { text: "per model / adapter (last hour)" }),
      table(["model / adapter", "requests", "tokens", "share", "errors"], Object.entries(by).map(([a, v]) => [a, fmt(v.requests), fmt(v.tokens), `${Math.round((v.share || 0) * 100)}%`, errorsText(v.errors)]), { "data-testid": "traffic-adapters" })));
    const be = totals.errors_by_endpoint || {};
    view.append(el("section", { class: "panel" }, el("h3", { text: "errors by endpoint (last hour)" }),
      Object.keys(be).length ? table(["endpoint", "status", "count"], Object.entries(be).flatMap(([ep, codes2]) => Object.entries(codes2).map(([c, n]) => [ep, c, fmt(n)]))) : el("p", { class: "empty", text: "none" })));
    return view;
  }

  function errorsText(errors) {
    const e = Object.entries(errors || {}).filter(([, n]) => n > 0);
    return e.length ? e.map(([c, n]) => `${fmt(n)}× ${c}`).join(", ") : "–";
  }

  function rewardsText(detail) {
    if (!detail || !Array.isArray(detail.rewards)) return "…";
    if (!detail.rewards.length) return "–";
    return detail.rewards.map((r) => `${fmt(r.value)} (${r.source || "?"})`).join(", ");
  }

  async function trajectoryDetail(id, refreshIt) {
    const cached = state.details.get(id);
    if (cached && !refreshIt) return cached;
    const d = await api(`/admin/trajectories/${encodeURIComponent(id)}`);
    state.details.set(id, d);
    if (state.details.size > 300) state.details.delete(state.details.keys().next().value);
    return d;
  }

  async function renderTrajectories() {
    const list = await optional(`/admin/trajectories?limit=25${state.rewardedOnly ? "&rewarded=true" : ""}`, { data: [] });
    const view = el("div");
    const toggle = el("input", { type: "checkbox", id: "rewarded-only", checked: state.rewardedOnly || undefined, onchange: (ev) => { state.rewardedOnly = ev.target.checked; refresh(); } });
    view.append(el("div", { class: "toolbar" }, el("label", {}, toggle, " rewarded only")));
    if (list.__error) view.append(errorNote(list));
    const rows = [];
    for (const t of list.data || []) {
      // reward values live in the trajectory's detail: fetched once per trajectory (again when its reward count changes)
      let d = state.details.get(t.trajectory_id);
      const stale = !d || (d.rewards || []).length + (d.turns || []).reduce((s, u) => s + (u.rewards || []).length, 0) < (t.rewards || 0) || (d.turns || []).length < (t.turns || 0);
      if (stale) {
        try {
          d = await trajectoryDetail(t.trajectory_id, true);
        } catch (e) {
          if (e.status === 401 || e.status === 403) throw e;
          d = null;
        }
      }
      const meta = t.meta && typeof t.meta === "object" ? t.meta : {};
      const adaptersUsed = d && Array.isArray(d.turns) ? [...new Set(d.turns.map((u) => u.adapter || "base"))].join(", ") : "…";
      rows.push(el("tr", { class: "clickable", tabindex: "0", dataset: { testid: "trajectory-row", id: t.trajectory_id }, onclick: () => openTrajectory(t.trajectory_id), onkeydown: (ev) => { if (ev.key === "Enter") openTrajectory(t.trajectory_id); } },
        el("td", { text: fmtTime(t.created_at) }),
        el("td", { text: [meta.agent, meta.task].filter(Boolean).join(" · ") || "chat" }),
        el("td", { class: "mono", text: String(t.session_id || "").slice(0, 28) }),
        el("td", { text: String(t.turns ?? "–") }),
        el("td", { text: adaptersUsed }),
        el("td", { dataset: { col: "rewards" }, text: rewardsText(d) })));
    }
    view.append(el("section", { class: "panel" }, el("h3", { text: "recent trajectories" }),
      rows.length ? table(["time", "agent / task", "session", "turns", "served by", "rewards"], rows, { class: "trajectories" }) : el("p", { class: "empty", text: "nothing recorded yet" })));
    return view;
  }

  function messageBlock(m) {
    const content = typeof m.content === "string" ? m.content : Array.isArray(m.content) ? m.content.map((p) => (p && typeof p.text === "string" ? p.text : "")).join("") : m.content == null ? "" : JSON.stringify(m.content);
    return el("div", { class: "msg role-" + String(m.role || "").replace(/[^a-z]/g, "") }, el("span", { class: "role", text: m.role || "?" }), el("pre", { text: content }));
  }

  async function openTrajectory(id) {
    const dlg = $("#trajectory");
    state.openTrajectory = id;
    const body = $("#trajectory-body");
    body.replaceChildren(el("p", { text: "loading…" }));
    if (!dlg.open) dlg.showModal();
    let d;
    try {
      d = await trajectoryDetail(id, true);
    } catch (e) {
      if (e.status === 401 || e.status === 403) { dlg.close(); return authFailed(e); }
      body.replaceChildren(el("p", { class: "error", text: e.message }));
      return;
    }
    $("#trajectory-title").textContent = `trajectory ${id}`;
    const parts = [kv([["session", d.session_id], ["created", fmtDateTime(d.created_at)], ["meta", JSON.stringify(d.meta || {})], ["rewards", rewardsText(d)]])];
    for (const u of d.turns || []) {
      const turn = el("section", { class: "turn", dataset: { testid: "turn" } });
      turn.append(el("h4", { text: `turn ${u.index} · ${u.adapter || "base"} · ${u.finish_reason}` }));
      turn.append(kv([
        ["tokens", `${(u.context_ids || []).length} in context, ${(u.output_ids || []).length} out`],
        ["latency", `${fmt(u.timings && u.timings.total_s, 2)} s`],
        ["tool calls", (u.tool_calls || []).map((c) => `${c.name}(${c.arguments})`).join("; ") || undefined],
      ]));
      const ms = Array.isArray(u.messages) ? u.messages : [];
      const shown = u.index > 0 ? ms.slice(-1) : ms; // later turns: only what is new (the earlier ones are above)
      for (const m of shown) turn.append(messageBlock(m));
      turn.append(messageBlock({ role: "assistant (output)", content: u.output_text || "" }));
      parts.push(turn);
    }
    const form = el("form", { class: "feedback", dataset: { testid: "feedback" } },
      el("label", {}, "reward ", el("input", { name: "reward", type: "number", step: "any", required: true, value: "1" })),
      el("label", {}, "source ", el("input", { name: "source", type: "text", value: "feedback", maxlength: "64" })),
      el("label", {}, "comment ", el("input", { name: "comment", type: "text", maxlength: "500" })),
      el("button", { type: "submit", class: "action" }, "post feedback"));
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const f = new FormData(form);
      const reward = Number(f.get("reward"));
      if (!Number.isFinite(reward)) return toast("the reward must be a number", "error");
      const payload = { trajectory_id: id, reward, source: f.get("source") || "feedback" };
      if (f.get("comment")) payload.comment = f.get("comment");
      try {
        await api("/admin/feedback", { method: "POST", body: payload });  // the admin key is not an API key: /v1 refuses it
        toast(`reward ${reward} posted`, "ok");
        openTrajectory(id);
      } catch (e) {
        toast(e.message, "error");
      }
    });
    parts.push(el("h4", { text: "post feedback on this trajectory" }), form);
    body.replaceChildren(...parts);
  }

  // ---- refresh loop -------------------------------------------------------------------------------
  const RENDER = { overview: renderOverview, experiments: renderExperiments, learners: renderLearners, traffic: renderTraffic, trajectories: renderTrajectories };

  async function refresh() {
    if (!sessionStorage.getItem(KEY)) return;
    if (state.busy) {
      state.again = true; // a view change or an action while a refresh runs: refresh once more right after
      return;
    }
    state.busy = true;
    state.again = false;
    clearTimeout(state.timer);
    const view = state.view;
    try {
      const readyResp = await fetch("/ready").then((r) => r.json()).catch(() => ({}));
      $("#model").textContent = readyResp.model ? `serving ${readyResp.model}` : "not ready";
      const content = await RENDER[view](readyResp);
      if (view === state.view) {
        const target = $("#view-" + view);
        target.replaceChildren(content);
        target.dataset.loaded = "true";
      }
      state.lastOk = Date.now();
      $("#status").textContent = `updated ${fmtTime(Date.now() / 1000)}`;
      $("#status").className = "ok";
      showApp();
    } catch (e) {
      if (e.status === 401 || e.status === 403) {
        state.busy = false;
        return authFailed(e);
      }
      $("#status").textContent = `refresh failed: ${e.message}`;
      $("#status").className = "error";
    }
    state.busy = false;
    if (state.again) return refresh();
    if (!document.hidden) state.timer = setTimeout(refresh, REFRESH_MS);
  }

  function stopPolling() {
    clearTimeout(state.timer);
    state.timer = null;
  }

  function go(view) {
    if (!VIEWS.includes(view)) view = "overview";
    state.view = view;
    for (const id of VIEWS) {
      $("#view-" + id).hidden = id !== view;
      const tab = document.querySelector(`nav a[data-view="${id}"]`);
      tab.classList.toggle("active", id === view);
      if (id === view) tab.setAttribute("aria-current", "page");
      else tab.removeAttribute("aria-current");
    }
    refresh();
  }

  // ---- start --------------------------------------------------------------------------------------
  // /console#key=... (the URL serve.py prints): keep the key for this tab and take it out of the address bar and history
  function takeKeyFromHash() {
    const hash = location.hash.slice(1);
    if (!hash.startsWith("key=")) return false;
    sessionStorage.setItem(KEY, decodeURIComponent(hash.slice(4)));
    state.details.clear();
    history.replaceState(null, "", location.pathname + "#overview");
    return true;
  }

  function start() {
    takeKeyFromHash();
    $("#login-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("#key").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY, key);
      $("#key").value = "";
      $("#login-error").textContent = "";
      state.details.clear();
      refresh();
    });
    $("#logout").addEventListener("click", () => {
      sessionStorage.removeItem(KEY);
      state.details.clear();
      showLogin("");
    });
    $("#trajectory-close").addEventListener("click", () => $("#trajectory").close());
    window.addEventListener("hashchange", () => go(takeKeyFromHash() ? "overview" : location.hash.slice(1)));
    document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
    let resizeTimer = null;
    window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(refresh, 300); });
    const first = location.hash.slice(1);
    if (!sessionStorage.getItem(KEY)) showLogin("");
    go(VIEWS.includes(first) ? first : "overview");
  }

  start();
})();
