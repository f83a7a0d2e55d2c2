// lensdiv explore: the page. Plain JavaScript, no library, nothing loaded from elsewhere.
"use strict";
(() => {
  const $ = (sel) => document.querySelector(sel);
  const token = new URLSearchParams(location.search).get("token");
  const headers = { "Content-Type": "application/json" };
  if (token) headers["X-Lensdiv-Token"] = token;
  const state = { info: null, grids: null, patchAbort: null, gridAbort: null, timer: 0, pinned: null,
    follow: true, scrollLeft: 0, syncing: false };  // follow: the grids keep their last positions in view

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }
  const shown = (t) => t.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
  const pct = (p) => (p === null || p === undefined ? "–" : (100 * p).toFixed(p < 0.1 ? 1 : 0) + "%");
  const colour = (p) => {  // white → blue, as the prompt view's probability scale
    const t = Math.max(0, Math.min(1, p || 0));
    const r = Math.round(255 - 200 * t), g = Math.round(255 - 150 * t), b = Math.round(255 - 40 * t);
    return `rgb(${r},${g},${b})`;
  };
  const ink = (p) => ((p || 0) > 0.6 ? "#fff" : "#1d2330");

  // -- errors: each tab shows its own; a failed request marks what it would have replaced stale -
  function showError(where, message) {  // where: "lens", "patch", "runs" (or "" for the page)
    const box = $(where ? `#error-${where}` : "#error");
    box.textContent = message || "";
    box.hidden = !message;
  }

  function markStale(where, stale) {  // the grids stay, dimmed, with a line saying why
    const parts = where === "lens" ? ["#grids", "#detail"] : ["#patch-grid", "#patch-result"];
    const old = stale && $(parts[0]).childNodes.length > 0;  // nothing drawn yet: nothing stale
    parts.forEach((sel) => $(sel).classList.toggle("stale", old));
    $(`#stale-${where}`).hidden = !old;
  }

  function failed(where, message) {
    showError(where, message);
    markStale(where, true);
  }

  function succeeded(where) {
    showError(where, "");
    markStale(where, false);
  }

  async function api(path, body, signal) {
    const response = await fetch(path, body === undefined ? { headers, signal } :
      { method: "POST", headers, body: JSON.stringify(body), signal });
    if (response.status === 204) return null;
    const data = await response.json();
    if (!response.ok) throw new Error(data.error || `${response.status}`);
    return data;
  }

  // -- the lens tab ----------------------------------------------------------------------------
  function chosenLenses() {
    return [...document.querySelectorAll("#lenses input:checked")].map((i) => i.value);
  }

  function schedule() {
    clearTimeout(state.timer);
    state.timer = setTimeout(refresh, 250);  // debounced: one request set per pause in typing
  }

  async function refresh() {
    if (state.gridAbort) state.gridAbort.abort();  // a superseded request is dropped
    const abort = new AbortController();
    state.gridAbort = abort;
    const text = $("#prompt").value;
    const topK = Number($("#top-k").value);
    const skip = $("#skip-block").value;
    const asks = chosenLenses().map((lens) => ({ text, lens, top_k: topK }));
    if (skip !== "") asks.push({ text, lens: "logit", top_k: topK, skip: Number(skip), part: $("#skip-part").value });
    $("#status").textContent = "…";
    try {
      const views = [];
      for (const ask of asks) views.push(await api("api/grid", ask, abort.signal));
      if (abort.signal.aborted || views.some((v) => v === null)) return;
      succeeded("lens");
      state.grids = views;
      state.text = text;  // what the grids show: a pinned cell's attention is asked of it
      drawGrids(views);
      const ms = views.reduce((s, v) => s + v.ms, 0);
      $("#status").textContent = `${views[0] ? views[0].tokens.length : 0} tokens · ${ms.toFixed(0)} ms`;
    } catch (err) {
      if (err.name === "AbortError") return;
      failed("lens", err.message);
      $("#status").textContent = "";
    }
  }

  function drawGrids(views) {
    const box = $("#grids");
    box.replaceChildren();
    $("#skip-kl").textContent = "";
    views.forEach((view, v) => {
      const skip = view.skip;
      const title = skip ? `${view.title}` : `${view.title}`;
      const panel = el("div", { class: "panel" + (skip ? " skip" : ""), "data-lens": skip ? "skip" : view.lens },
        el("h2", {}, title), el("p", { class: "note muted" }, view.note));
      if (skip) {
        const kl = `output KL to the unskipped run: ${skip.mean_output_kl.toFixed(3)} nats (mean over positions ≥ 1)`;
        panel.append(el("div", { class: "muted skip-kl" }, kl));
        $("#skip-kl").textContent = `KL ${skip.mean_output_kl.toFixed(3)} nats`;
      }
      const table = el("table", { class: "grid" });
      const head = el("tr", {}, el("th", {}, ""));
      view.tokens.forEach((t, i) => head.append(el("th", { title: `position ${i}` }, shown(t))));
      table.append(el("thead", {}, head));
      const body = el("tbody");
      for (let r = view.rows.length - 1; r >= 0; r--) {  // the output on top
        const tr = el("tr", {}, el("th", {}, view.rows[r]));
        view.tokens.forEach((_, t) => {
          const p = view.top_probs[r][t][0];
          const td = el("td", { "data-view": v, "data-row": r, "data-pos": t },
            shown(view.top_tokens[r][t][0]), el("small", {}, pct(p)));
          td.style.background = colour(p);
          td.style.color = ink(p);
          tr.append(td);
        });
        body.append(tr);
      }
      table.append(body);
      table.addEventListener("mouseover", (e) => { const td = e.target.closest("td"); if (td && !state.pinned) detail(td); });
      table.addEventListener("click", (e) => {
        const td = e.target.closest("td");
        if (!td) return;
        document.querySelectorAll("td.pinned").forEach((c) => c.classList.remove("pinned"));
        if (state.pinned === key(td)) { state.pinned = null; return; }
        state.pinned = key(td);
        td.classList.add("pinned");
        detail(td);
      });
      panel.append(el("div", { class: "scroller" }, table));
      box.append(panel);
    });
    alignColumns([...box.querySelectorAll("table.grid")]);
    linkScrolling([...box.querySelectorAll(".scroller")]);
    if (state.pinned) {
      const [view, row, pos] = state.pinned.split(",");
      const td = document.querySelector(`td[data-view="${view}"][data-row="${row}"][data-pos="${pos}"]`);
      if (td) { td.classList.add("pinned"); detail(td); } else state.pinned = null;
    }
  }
  const key = (td) => [td.dataset.view, td.dataset.row, td.dataset.pos].join();

  // -- the grids' columns: aligned across lenses, scrolled together, opening on the last ------
  function alignColumns(tables) {  // every column as wide as its widest cell in any table
    if (tables.length < 2) return;
    const heads = tables.map((t) => [...t.querySelectorAll("thead th")]);
    const widths = heads[0].map((_, c) => Math.max(...heads.map((h) => h[c].getBoundingClientRect().width)));
    heads.forEach((h) => h.forEach((th, c) => { th.style.minWidth = `${widths[c]}px`; }));
  }

  function linkScrolling(scrollers) {
    const follow = () => {  // opens on the last positions unless the reader scrolled away
      const [first] = scrollers;
      if (!first) return;
      const left = state.follow ? first.scrollWidth : Math.min(state.scrollLeft, first.scrollWidth);
      scrollers.forEach((s) => { s.scrollLeft = left; });
    };
    scrollers.forEach((s) => s.addEventListener("scroll", () => {
      if (state.syncing) return;
      state.syncing = true;
      scrollers.forEach((o) => { if (o !== s) o.scrollLeft = s.scrollLeft; });
      state.syncing = false;
      state.follow = s.scrollLeft + s.clientWidth >= s.scrollWidth - 2;
      state.scrollLeft = s.scrollLeft;
      windowNote();
    }));
    follow();
    windowNote();
  }

  function windowNote() {  // which positions are in view, and how to reach the others
    const scroller = document.querySelector("#grids .scroller");
    const note = $("#grid-window");
    if (!scroller) { note.hidden = true; return; }
    const heads = [...scroller.querySelectorAll("thead th")];
    const label = heads.shift();
    const left = scroller.getBoundingClientRect().left + (label ? label.getBoundingClientRect().width : 0);
    const right = scroller.getBoundingClientRect().left + scroller.clientWidth;
    const seen = heads.map((th, i) => [i, th.getBoundingClientRect()])
      .filter(([, r]) => r.right > left + 2 && r.left < right - 2).map(([i]) => i);
    const n = heads.length;
    const all = seen.length === n;
    note.hidden = all;
    if (!all && seen.length) {
      $("#grid-window-text").textContent =
        `positions ${seen[0]}–${seen[seen.length - 1]} of ${n} in view (the first is 0): scroll sideways for the rest`;
    }
  }

  function scrollGrids(toEnd) {
    state.follow = toEnd;
    document.querySelectorAll("#grids .scroller").forEach((s) => { s.scrollLeft = toEnd ? s.scrollWidth : 0; });
  }

  function detail(td) {
    const view = state.grids[Number(td.dataset.view)];
    const r = Number(td.dataset.row), t = Number(td.dataset.pos);
    const rows = view.top_tokens[r][t].map((tok, i) => el("tr", {}, el("td", {}, shown(tok)), el("td", {}, pct(view.top_probs[r][t][i]))));
    $("#detail").replaceChildren(
      el("h3", {}, `${view.rows[r]} · position ${t} (${shown(view.tokens[t])})`),
      el("div", { class: "muted" }, view.title),
      el("table", { class: "topk" }, ...rows),
      el("p", {}, `KL to the output: ${view.kl[r][t] === null ? "–" : view.kl[r][t].toFixed(3)} nats`),
      el("p", {}, `entropy: ${view.entropy[r][t].toFixed(3)} nats`),
    );
    if (state.pinned === key(td)) { says(view, r, t); attention(view, r, t); }
  }

  // -- a pinned cell's state read by the model itself: the patchscope's greedy continuation ----
  async function says(view, r, t) {
    const row = Number(String(view.rows[r]).replace(/^h/, ""));
    const lens = String(view.lens || "").startsWith("patchscope") ? view.lens : "patchscope";
    const box = el("div", { id: "says", class: "says" }, el("p", { class: "muted" }, "what the model says …"));
    $("#detail").append(box);
    let out;
    try {
      out = await api("api/says", { text: state.text, row, position: t, lens });
    } catch (err) {
      box.replaceChildren(el("p", { class: "muted" }, `what the model says: ${err.message}`));
      return;
    }
    if (!out) return;
    const where = out.target >= state.info.n_layers ? "as the final residual (no block runs after it)" : `as block ${out.target}'s input`;
    const prompt = out.prompt.map((tok, k) => (k === out.patched ? el("mark", { title: `h${row} patched in here, ${where}` }, shown(tok)) : shown(tok)));
    const said = out.tokens.map((tok, k) => el("span", { class: "said", title: pct(out.probs[k]) }, shown(tok)));
    box.replaceChildren(
      el("h3", {}, `what the model says about h${row} here`),
      el("p", { class: "prompt-line" }, ...prompt, " → ", ...said),
      el("p", { class: "muted" }, `${out.lens}: h${row} at position ${t} patched into the inspection prompt (the marked token) ${where}; the model's greedy continuation, ${out.tokens.length} tokens (hover for each one's probability).`),
    );
  }

  // -- a pinned cell's attention: the block that wrote h_r (block 0 for h0), its query at t ----
  async function attention(view, r, t) {
    const block = Math.max(r - 1, 0);
    const box = el("div", { id: "attention", class: "attention" }, el("p", { class: "muted" }, "attention …"));
    $("#detail").append(box);
    let out;
    try {
      out = await api("api/attention", { text: state.text, block, position: t });
    } catch (err) {
      box.replaceChildren(el("p", { class: "muted" }, `attention: ${err.message}`));
      return;
    }
    if (!out) return;
    const cells = (weights) => weights.map((w, k) => {
      const td = el("td", { title: `${shown(out.tokens[k])}: ${pct(w)}`, class: k < out.first ? "sink" : "" }, "");
      td.style.background = colour(w);
      return td;
    });
    const head = el("tr", {}, el("th", {}, ""), ...out.tokens.map((tok, k) => el("th", { class: k < out.first ? "sink" : "" }, shown(tok))));
    const rows = [el("tr", {}, el("th", {}, "mean"), ...cells(out.mean))];
    out.heads.forEach((w, h) => rows.push(el("tr", { class: out.sink_heads.includes(h) ? "sink-head" : "" }, el("th", {}, `head ${h}`), ...cells(w))));
    const sinks = out.sink_heads.length ? `sink heads (> 30 % on the first token): ${out.sink_heads.join(", ")}` : "no sink head (none puts > 30 % on the first token)";
    const top = out.mean.map((w, k) => [w, k]).sort((a, b) => b[0] - a[0]).slice(0, 3)
      .map(([w, k]) => `${shown(out.tokens[k])} (position ${k}) ${pct(w)}`).join(", ");
    const scroller = el("div", { class: "scroller" }, el("table", { class: "attn" }, el("thead", {}, head), el("tbody", {}, ...rows)));
    box.replaceChildren(
      el("h3", {}, `attention of block ${out.block} at position ${t}`),
      el("p", { class: "muted" }, `mean over heads on the first token: ${pct(out.mean[0])}; ${sinks}`),
      el("p", { class: "muted" }, `most attended (mean over heads): ${top}`),
      scroller,
      el("p", { class: "muted" }, "columns: the keys, position 0 (the sink, outlined) first; rows: the mean over heads, then each head (sink heads in orange)."),
    );
    scroller.scrollLeft = scroller.scrollWidth;  // the keys nearest the query in view
  }

  // -- the patch tab ---------------------------------------------------------------------------
  function patchAsk(extra) {
    return { clean: $("#clean").value, corrupt: $("#corrupt").value, target: $("#target").value, ...extra };
  }

  async function patchCall(extra) {
    if (state.patchAbort) state.patchAbort.abort();
    const abort = new AbortController();
    state.patchAbort = abort;
    try {
      const out = await api("api/patch", patchAsk(extra), abort.signal);
      if (out === null) return null;
      succeeded("patch");
      return out;
    } catch (err) {
      if (err.name !== "AbortError") failed("patch", err.message);
      return null;
    }
  }

  function drawPatchGrid(tokens, rows) {
    const table = el("table", { class: "grid", id: "patch-table" });
    const head = el("tr", {}, el("th", {}, ""));
    tokens.forEach((t) => head.append(el("th", {}, shown(t))));
    table.append(el("thead", {}, head));
    const body = el("tbody");
    for (let r = rows - 1; r >= 0; r--) {
      const tr = el("tr", {}, el("th", {}, `h${r}`));
      tokens.forEach((_, t) => tr.append(el("td", { "data-layer": r, "data-pos": t }, "·")));
      body.append(tr);
    }
    table.append(body);
    table.addEventListener("click", async (e) => {
      const td = e.target.closest("td");
      if (!td) return;
      const layer = Number(td.dataset.layer), position = Number(td.dataset.pos);
      const out = await patchCall({ layer, position });
      if (!out) return;
      fill(td, out.patched_prob, out);
      document.querySelectorAll("#patch-table td.pinned").forEach((c) => c.classList.remove("pinned"));
      td.classList.add("pinned");
      const moved = out.recovered === null ? "" : ` (${(100 * out.recovered).toFixed(0)}% of the way to clean)`;
      $("#patch-result").textContent =
        `patch h${layer} at position ${position} (${shown(out.corrupt_tokens[position])}): ` +
        `p(${shown(out.target)}) ${pct(out.corrupt_prob)} → ${pct(out.patched_prob)}${moved}; clean ${pct(out.clean_prob)}`;
    });
    const scroller = el("div", { class: "scroller" }, table);
    $("#patch-grid").replaceChildren(el("div", { class: "panel" }, scroller));
    scroller.scrollLeft = scroller.scrollWidth;  // the last position (where the target is read) in view
  }

  function fill(td, p, out) {  // colour: the share of the corrupt → clean gap the patch recovers
    const gap = out.clean_prob - out.corrupt_prob;
    const s = Math.abs(gap) > 1e-9 ? (p - out.corrupt_prob) / gap : 0;
    td.replaceChildren(pct(p));
    td.style.background = colour(s);
    td.style.color = ink(s);
  }

  async function patchSetup() {  // the corrupt prompt's tokens as columns, h_L … h0 as rows
    const out = await patchCall({ layer: 0, position: 0 });
    if (!out) return;
    drawPatchGrid(out.corrupt_tokens, state.info.n_layers + 1);
    $("#patch-result").textContent =
      `target ${shown(out.target)}: p = ${pct(out.clean_prob)} clean, ${pct(out.corrupt_prob)} corrupt. Click a cell to patch it.`;
  }

  async function patchMap() {  // piece by piece: the server is never held for a whole map
    if (state.patchAbort) state.patchAbort.abort();  // a newer map (or cell) supersedes it
    const abort = new AbortController();
    state.patchAbort = abort;
    const ask = patchAsk({ map: true, layer: 0, start: 0 });
    let out = null, done = 0, total = 0;
    try {
      for (;;) {
        out = await api("api/patch", ask, abort.signal);
        if (out === null || abort.signal.aborted) return;
        if (total === 0) {
          succeeded("patch");
          total = (state.info.n_layers + 1) * out.corrupt_tokens.length;
          drawPatchGrid(out.corrupt_tokens, state.info.n_layers + 1);
        }
        out.probs.forEach((p, i) => fill(document.querySelector(
          `#patch-table td[data-layer="${out.layer}"][data-pos="${out.start + i}"]`), p, out));
        done += out.probs.length;
        if (!out.next) break;
        $("#patch-result").textContent = `full map: ${done} of ${total} patches (${Math.floor(100 * done / total)}%)…`;
        Object.assign(ask, out.next);
      }
    } catch (err) {
      if (err.name !== "AbortError") failed("patch", err.message);
      return;
    }
    $("#patch-result").textContent =
      `full map: p(${shown(out.target)}) at the last position with the clean h_l copied in at each (layer, position); clean ${pct(out.clean_prob)}, corrupt ${pct(out.corrupt_prob)} (colour: the share of the gap recovered)`;
  }

  function patchExample(info) {  // the session's example pair: one where patching moves the answer
    const example = info.patch_example;
    if (!example) return;
    $("#clean").value = example.clean;
    $("#corrupt").value = example.corrupt;
    $("#target").value = example.target;
    $("#patch-about").textContent = `The example: ${example.about}.`;
  }

  // -- the runs tab ----------------------------------------------------------------------------
  async function loadRuns() {
    const body = $("#runs tbody");
    try {
      const out = await api("api/runs");
      body.replaceChildren();
      for (const run of out.runs) {
        const link = el("a", { href: `runs/${run.page}${token ? "?token=" + encodeURIComponent(token) : ""}`, class: "open-run" }, run.path || "(the runs folder)");
        link.addEventListener("click", (e) => {
          e.preventDefault();
          const frame = $("#run-frame");
          frame.hidden = false;
          frame.src = link.getAttribute("href");
        });
        body.append(el("tr", {}, el("td", {}, run.kind), el("td", {}, link), el("td", {}, run.model), el("td", {}, run.status), el("td", {}, run.what)));
      }
      const empty = $("#runs-empty");
      empty.hidden = out.runs.length > 0;
      empty.textContent = state.info.runs ? "No run or study with a page under the runs folder." : "Start lensdiv explore with --runs DIR to list saved runs and studies here.";
      showError("runs", "");
    } catch (err) { showError("runs", err.message); }
  }

  function tab(name) {
    document.querySelectorAll(".tab").forEach((b) => b.classList.toggle("active", b.dataset.tab === name));
    document.querySelectorAll(".pane").forEach((p) => { p.hidden = p.id !== `pane-${name}`; });
    if (name === "runs") loadRuns();
    if (name === "patch" && !$("#patch-table")) patchSetup();
  }

  async function start() {
    try {
      state.info = await api("api/info");
    } catch (err) { showError("", err.message); return; }
    const info = state.info;
    $("#model").textContent = `${info.model} · ${info.n_layers} blocks · d_model ${info.d_model} · context ${info.n_ctx}`;
    $("#legend-top").replaceChildren(`h${info.n_layers}`);
    info.lenses.forEach((name, i) => {
      const box = el("input", { type: "checkbox", value: name });
      box.checked = i === 0;
      box.addEventListener("change", refresh);
      $("#lenses").append(el("label", {}, box, ` ${name}`));
    });
    for (let b = 0; b < info.n_layers; b++) $("#skip-block").append(el("option", { value: b }, `block ${b}`));
    info.parts.forEach((p) => $("#skip-part").append(el("option", { value: p }, p)));
    $("#prompt").addEventListener("input", () => { state.follow = true; schedule(); });
    $("#grid-first").addEventListener("click", () => scrollGrids(false));
    $("#grid-last").addEventListener("click", () => scrollGrids(true));
    window.addEventListener("resize", windowNote);
    patchExample(info);
    ["#skip-block", "#skip-part", "#top-k"].forEach((s) => $(s).addEventListener("change", refresh));
    document.querySelectorAll(".tab").forEach((b) => b.addEventListener("click", () => tab(b.dataset.tab)));
    $("#patch-map").addEventListener("click", patchMap);
    ["#clean", "#corrupt", "#target"].forEach((s) => $(s).addEventListener("change", patchSetup));
    // A link may open the page on a prompt (the course prints such links): ?text=…&skip=N for the
    // lens tab, ?clean=…&corrupt=…&tab=patch for the patch tab.
    const ask = new URLSearchParams(location.search);
    if (ask.has("text")) $("#prompt").value = ask.get("text");
    if (ask.has("skip")) $("#skip-block").value = ask.get("skip");
    if (ask.has("clean")) $("#clean").value = ask.get("clean");
    if (ask.has("corrupt")) $("#corrupt").value = ask.get("corrupt");
    refresh();
    if (["patch", "runs"].includes(ask.get("tab"))) tab(ask.get("tab"));
  }
  start();
})();
