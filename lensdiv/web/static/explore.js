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
  const shown = (t) => t.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5")
    .replace(/[\u0000-\u001f\u007f]/g, (c) => `<0x${c.charCodeAt(0).toString(16).toUpperCase().padStart(2, "0")}>`);  // other control characters
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
    const parts = where === "lens" ? ["#grids", "#detail", "#attention-panel"] : ["#patch-grid", "#patch-result"];
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

  const NOT_ANSWERING = "the server is not answering: is lensdiv explore still running? " +
    "(start it again, then reload this page)";

  async function api(path, body, signal) {
    let response;
    try {
      response = await fetch(path, body === undefined ? { headers, signal } :
        { method: "POST", headers, body: JSON.stringify(body), signal });
    } catch (err) {  // the browser's "Failed to fetch": nothing answered
      if (err.name === "AbortError") throw err;
      throw new Error(NOT_ANSWERING);
    }
    if (response.status === 204) return null;
    let data;
    try { data = await response.json(); } catch (err) {
      throw new Error(response.ok ? NOT_ANSWERING : `the server answered ${response.status}`);
    }
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

  const rowNumber = (name) => Number(String(name).replace(/^h/, ""));

  function drawGrids(views) {
    const box = $("#grids");
    box.replaceChildren();
    $("#skip-kl").textContent = "";
    // every panel shows the same rows (h0 … h_L), a row a lens does not read left blank, so the
    // panels' rows line up side by side
    const names = [...new Set(views.flatMap((v) => v.rows))].sort((a, b) => rowNumber(a) - rowNumber(b));
    views.forEach((view, v) => {
      const skip = view.skip;
      const head = el("div", { class: "panel-head" },
        el("div", { class: "panel-title" }, el("h2", {}, view.title), csvLink(view)),
        el("p", { class: "note muted" }, view.note));
      const panel = el("div", { class: "panel" + (skip ? " skip" : ""), "data-lens": skip ? "skip" : view.lens }, head);
      if (skip) {
        const kl = `output KL to the unskipped run: ${skip.mean_output_kl.toFixed(3)} nats (mean over positions ≥ 1)`;
        head.append(el("div", { class: "muted skip-kl" }, kl));
        $("#skip-kl").textContent = `KL ${skip.mean_output_kl.toFixed(3)} nats`;
      }
      const table = el("table", { class: "grid" });
      const top = el("tr", {}, el("th", {}, ""));
      view.tokens.forEach((t, i) => top.append(el("th", { title: `position ${i}` }, shown(t))));
      table.append(el("thead", {}, top));
      const body = el("tbody");
      for (let n = names.length - 1; n >= 0; n--) {  // the output on top
        const r = view.rows.indexOf(names[n]);
        if (r < 0) {
          body.append(el("tr", { class: "missing" }, el("th", {}, names[n]),
            el("td", { class: "none", colspan: view.tokens.length },
              el("span", {}, `— this lens does not read ${names[n]}`), el("small", {}, "\u00a0"))));  // a cell's two lines
          continue;
        }
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
      table.addEventListener("mouseover", (e) => { const td = e.target.closest("td[data-row]"); if (td && !state.pinned) detail(td); });
      table.addEventListener("click", (e) => {
        const td = e.target.closest("td[data-row]");
        if (!td) return;
        document.querySelectorAll("td.pinned").forEach((c) => c.classList.remove("pinned"));
        if (state.pinned === key(td)) { state.pinned = null; $("#attention-panel").hidden = true; return; }
        state.pinned = key(td);
        td.classList.add("pinned");
        detail(td);
      });
      panel.append(el("div", { class: "scroller" }, table));
      box.append(panel);
    });
    alignColumns([...box.querySelectorAll("table.grid")]);
    sameHeight([...box.querySelectorAll(".panel-head")]);
    linkScrolling([...box.querySelectorAll(".scroller")]);
    if (state.pinned) {
      const [view, row, pos] = state.pinned.split(",");
      const td = document.querySelector(`td[data-view="${view}"][data-row="${row}"][data-pos="${pos}"]`);
      if (td) { td.classList.add("pinned"); detail(td); } else { state.pinned = null; $("#attention-panel").hidden = true; }
    }
  }

  // -- export: what a grid shows, as CSV ---------------------------------------------------------
  const csvField = (v) => (/[",\n\r]/.test(String(v)) ? `"${String(v).replace(/"/g, '""')}"` : String(v));
  const csvHref = (rows) => "data:text/csv;charset=utf-8," +
    encodeURIComponent(rows.map((r) => r.map(csvField).join(",")).join("\n") + "\n");

  function gridCsv(view) {  // one line per cell: its top-k, KL, entropy and the next token
    const k = view.top_tokens[0][0].length;
    const head = ["row", "position", "token", "next_token", "next_prob", "next_rank (1 = top-1)", "kl_to_output", "entropy"];
    for (let i = 1; i <= k; i++) head.push(`top${i}`, `p${i}`);
    const rows = [head];
    view.rows.forEach((name, r) => view.tokens.forEach((tok, t) => {
      const line = [name, t, tok, t + 1 < view.tokens.length ? view.tokens[t + 1] : "",
        view.next_prob[r][t] ?? "", view.next_rank[r][t] >= 0 ? view.next_rank[r][t] + 1 : "",
        view.kl[r][t] ?? "", view.entropy[r][t]];
      view.top_tokens[r][t].forEach((tok2, i) => line.push(tok2, view.top_probs[r][t][i]));
      rows.push(line);
    }));
    return rows;
  }

  function csvLink(view) {
    const name = (view.skip ? `skip-block${view.skip.block}-${view.skip.part}` : view.lens).replace(/[^\w.-]+/g, "_");
    return el("a", { class: "csv small", download: `lensdiv-${name}.csv`, href: csvHref(gridCsv(view)),
      title: "download this grid as CSV: one line per cell (top-k, KL to the output, entropy, the next token's probability and rank)" }, "CSV");
  }

  const key = (td) => [td.dataset.view, td.dataset.row, td.dataset.pos].join();

  // -- the grids' columns: aligned across lenses, scrolled together, opening on the last ------
  function alignColumns(tables) {  // every column as wide as its widest cell in any table
    if (tables.length < 2) return;
    const heads = tables.map((t) => [...t.querySelectorAll("thead th")]);
    const widths = heads[0].map((_, c) => Math.max(...heads.map((h) => h[c].getBoundingClientRect().width)));
    heads.forEach((h) => h.forEach((th, c) => { th.style.minWidth = `${widths[c]}px`; }));
  }

  function sameHeight(heads) {  // titles and notes of different lengths: the tables start level
    heads.forEach((h) => { h.style.minHeight = ""; });
    const tallest = Math.max(0, ...heads.map((h) => h.getBoundingClientRect().height));
    if (heads.length > 1) heads.forEach((h) => { h.style.minHeight = `${tallest}px`; });
  }

  // A scrolled table stops on a column's edge just right of its sticky row labels (CSS scroll
  // snapping), so no column hides half under them; the table gets room after its last column
  // for the furthest stop to be such an edge too.
  function snapColumns(scroller) {
    const table = scroller.querySelector("table");
    if (!table || !table.querySelector("thead th")) return;
    table.style.marginRight = "0px";
    const all = [...table.querySelectorAll("thead tr:last-child th")];
    const fixed = all.filter((th) => getComputedStyle(th).position === "sticky");  // the row labels (and a sink)
    // both whatever the scroll: a stuck cell against the scroller, a column against its table
    const box = scroller.getBoundingClientRect().left + scroller.clientLeft;
    const labelWidth = Math.max(0, ...fixed.map((th) => th.getBoundingClientRect().right - box));
    scroller.style.scrollPaddingLeft = `${labelWidth}px`;
    const heads = all.filter((th) => !fixed.includes(th));
    const most = scroller.scrollWidth - scroller.clientWidth;
    if (most <= 0) return;
    const origin = table.getBoundingClientRect().left;
    const stops = heads.map((th) => th.getBoundingClientRect().left - origin - labelWidth);
    const last = stops.find((x) => x >= most - 0.5);
    if (last !== undefined) table.style.marginRight = `${Math.ceil(last - most)}px`;
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
    state.relayout = () => {  // again once shown (a hidden tab has no widths) or resized
      scrollers.forEach(snapColumns);
      follow();
      windowNote();
    };
    state.relayout();
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
      nextToken(view, r, t),
    );
    if (state.pinned === key(td)) { says(view, r, t); attention(view, r, t); }
  }

  function nextToken(view, r, t) {  // the token that does come next in the prompt
    if (t + 1 >= view.tokens.length) return el("p", { class: "next muted" }, "the next token: none (the prompt's last position)");
    const rank = view.next_rank[r][t] + 1;  // the API counts from 0 (the top-1)
    return el("p", { class: "next" }, "the next token ", el("code", {}, shown(view.tokens[t + 1])),
      `: ${pct(view.next_prob[r][t])}, rank ${rank}${rank === 1 ? " (the top-1)" : ""}`);
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
  // A full-width panel under the grids: a column per key with its token written out, the sink
  // (the first token) kept in view at the left, a row per head that a click enlarges, and a
  // logarithmic colour scale on which a weight of 1 % is still visibly tinted.
  const attnShade = (w) => Math.max(0, Math.min(1, (Math.log10(Math.max(w || 0, 1e-9)) + 3) / 3));

  async function attention(view, r, t) {
    const block = Math.max(r - 1, 0);
    const box = $("#attention-panel");
    box.hidden = false;
    box.replaceChildren(el("p", { class: "muted" }, "attention …"));
    let out;
    try {
      out = await api("api/attention", { text: state.text, block, position: t });
    } catch (err) {
      box.replaceChildren(el("p", { class: "muted" }, `attention: ${err.message}`));
      return;
    }
    if (!out) return;
    const sinkCls = (k) => (k < out.first ? "sink" : "");
    const cells = (weights) => weights.map((w, k) => {
      const td = el("td", { title: `${shown(out.tokens[k])} (position ${k}): ${pct(w)}`, class: sinkCls(k) },
        el("span", { class: "w" }, pct(w)));
      td.style.background = colour(attnShade(w));
      td.style.color = ink(attnShade(w));
      return td;
    });
    const rowHead = (label, extra) => el("th", { class: "row-label" },
      el("button", { class: "enlarge", title: "enlarge this row (its weights written out); click again to shrink" }, label), extra || "");
    const head = el("tr", {}, el("th", { class: "row-label" }, "keys →"),
      ...out.tokens.map((tok, k) => el("th", { class: `key ${sinkCls(k)}`, title: `position ${k}` }, el("span", {}, shown(tok)))));
    const rows = [el("tr", { class: "mean" }, rowHead("mean"), ...cells(out.mean))];
    out.heads.forEach((w, h) => rows.push(el("tr", { class: out.sink_heads.includes(h) ? "sink-head" : "" },
      rowHead(`head ${h}`, el("small", {}, ` ${pct(out.sink_mass[h])} sink`)), ...cells(w))));
    const table = el("table", { class: "attn" }, el("thead", {}, head), el("tbody", {}, ...rows));
    const scroller = el("div", { class: "scroller" }, table);
    const resized = (change) => {  // cells change width: the same keys' end kept in view, snapped again
      const atEnd = scroller.scrollLeft + scroller.clientWidth >= scroller.scrollWidth - 2;
      change();
      snapColumns(scroller);
      if (atEnd) scroller.scrollLeft = scroller.scrollWidth;
    };
    table.addEventListener("click", (e) => {
      const button = e.target.closest("button.enlarge");
      if (button) resized(() => button.closest("tr").classList.toggle("big"));
    });
    const sinks = out.sink_heads.length ? `sink heads (> 30 % on the first token): ${out.sink_heads.join(", ")}` : "no sink head (none puts > 30 % on the first token)";
    const top = out.mean.map((w, k) => [w, k]).sort((a, b) => b[0] - a[0]).slice(0, 3)
      .map(([w, k]) => `${shown(out.tokens[k])} (position ${k}) ${pct(w)}`).join(", ");
    const all = el("button", { class: "small", id: "attn-enlarge" }, "enlarge all rows");
    all.addEventListener("click", () => resized(() => {
      const big = !table.querySelector("tbody tr:not(.big)");
      table.querySelectorAll("tbody tr").forEach((tr) => tr.classList.toggle("big", !big));
      all.textContent = big ? "enlarge all rows" : "shrink all rows";
    }));
    box.replaceChildren(
      el("h3", {}, `attention of block ${out.block} at position ${t} (${shown(out.tokens[t])}) — the block that wrote ${view.rows[r]}`, " ", all),
      el("p", { class: "muted" }, `mean over heads on the first token: ${pct(out.mean[0])}; ${sinks}; most attended (mean over heads): ${top}.`),
      el("p", { class: "muted scale-note" }, "columns: the keys 0 … ", String(t), ", the sink (position 0, outlined) kept at the left; rows: the mean over heads, then each head (sink heads in orange; click a row's name to enlarge it). ",
        el("span", { class: "scale" }, el("span", {}, "colour: the weight on a log scale"),
          el("i", { class: "ramp" }), el("span", {}, "≤ 0.1 % · 1 % · 10 % · 100 %"))),
      scroller,
    );
    snapColumns(scroller);
    scroller.scrollLeft = scroller.scrollWidth;  // the keys nearest the query in view; the sink stays
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

  function drawPatchGrid(out, rows) {  // the two prompts' tokens as columns, where they differ marked
    const differ = new Set(out.differ);
    const mark = (t) => (differ.has(t) ? "differ" : "");
    const table = el("table", { class: "grid", id: "patch-table" });
    const clean = el("tr", { class: "clean-row" }, el("th", {}, "clean"));
    const corrupt = el("tr", {}, el("th", {}, "corrupt"));
    out.corrupt_tokens.forEach((tok, t) => {
      const why = differ.has(t) ? `position ${t}: the prompts differ here` : `position ${t}`;
      clean.append(el("th", { class: mark(t), title: why }, shown(out.clean_tokens[t])));
      corrupt.append(el("th", { class: mark(t), title: why }, shown(tok)));
    });
    table.append(el("thead", {}, clean, corrupt));
    const body = el("tbody");
    for (let r = rows - 1; r >= 0; r--) {
      const tr = el("tr", {}, el("th", {}, `h${r}`));
      out.corrupt_tokens.forEach((_, t) => tr.append(el("td", { "data-layer": r, "data-pos": t, class: mark(t) }, "·")));
      body.append(tr);
    }
    table.append(body);
    table.addEventListener("click", async (e) => {
      const td = e.target.closest("td");
      if (!td) return;
      const layer = Number(td.dataset.layer), position = Number(td.dataset.pos);
      const cell = await patchCall({ layer, position });
      if (!cell) return;
      fill(td, cell.patched_prob, cell);
      document.querySelectorAll("#patch-table td.pinned").forEach((c) => c.classList.remove("pinned"));
      td.classList.add("pinned");
      const moved = cell.recovered === null ? (cell.gap_note ? " (no share of the gap: it is too small)" : "") :
        ` (${(100 * cell.recovered).toFixed(0)}% of the way to clean)`;
      $("#patch-result").textContent =
        `patch h${layer} at position ${position} (${shown(cell.corrupt_tokens[position])}): ` +
        `p(${shown(cell.target)}) ${pct(cell.corrupt_prob)} → ${pct(cell.patched_prob)}${moved}; clean ${pct(cell.clean_prob)}`;
    });
    const scroller = el("div", { class: "scroller" }, table);
    $("#patch-grid").replaceChildren(el("div", { class: "panel" }, scroller));
    state.patchFollow = true;
    scroller.addEventListener("scroll", () => {
      if (!state.patchScrolling) state.patchFollow = scroller.scrollLeft + scroller.clientWidth >= scroller.scrollWidth - 2;
    });
    answerInView();
  }

  function answerInView() {  // the last position (where the target is read) in view, once the cells are filled
    const scroller = $("#patch-grid .scroller");
    if (!scroller || !state.patchFollow) return;
    snapColumns(scroller);
    state.patchScrolling = true;
    scroller.scrollLeft = scroller.scrollWidth;
    state.patchScrolling = false;
  }

  function fill(td, p, out) {  // colour: the share of the corrupt → clean gap the patch recovers
    td.replaceChildren(pct(p));
    td.classList.toggle("no-share", !!out.gap_note);
    if (out.gap_note) {  // a gap too small to share: the probability only, in grey
      td.style.background = "";
      td.style.color = "";
      td.title = "no colour: the clean − corrupt gap is under the threshold";
      return;
    }
    const s = (p - out.corrupt_prob) / out.gap;
    td.style.background = colour(s);
    td.style.color = ink(s);
    td.title = `p(target) ${pct(p)}: ${(100 * s).toFixed(0)}% of the gap recovered`;
  }

  function gapWarning(out) {  // the server's reason a map would colour noise, and the map refused
    const box = $("#patch-gap");
    box.hidden = !out.gap_note;
    box.textContent = out.gap_note ? `No patching map: ${out.gap_note}. Type a target the two ` +
      "prompts disagree on, or change a prompt; a clicked cell shows p(target) alone, in grey." : "";
    $("#patch-map").disabled = !!out.gap_note;
    $("#patch-map").title = out.gap_note ? "refused: the two prompts give the target about the same probability" : "";
  }

  async function patchSetup() {  // the two prompts' tokens as columns, h_L … h0 as rows
    const out = await patchCall({ layer: 0, position: 0 });
    if (!out) return;
    drawPatchGrid(out, state.info.n_layers + 1);
    gapWarning(out);
    $("#patch-result").textContent =
      `target ${shown(out.target)}: p = ${pct(out.clean_prob)} clean, ${pct(out.corrupt_prob)} corrupt. ` +
      (out.differ.length ? `The prompts differ at position${out.differ.length === 1 ? "" : "s"} ${out.differ.join(", ")} (marked).` :
        "The prompts are the same token for token.") + " Click a cell to patch it.";
  }

  async function patchMap() {  // piece by piece: the server is never held for a whole map
    if (state.patchAbort) state.patchAbort.abort();  // a newer map (or cell) supersedes it
    const abort = new AbortController();
    state.patchAbort = abort;
    const ask = patchAsk({ map: true, layer: 0, start: 0 });
    let out = null, done = 0, total = 0;
    const filled = [];
    try {
      for (;;) {
        out = await api("api/patch", ask, abort.signal);
        if (out === null || abort.signal.aborted) return;
        if (total === 0) {
          succeeded("patch");
          total = (state.info.n_layers + 1) * out.corrupt_tokens.length;
          drawPatchGrid(out, state.info.n_layers + 1);
          gapWarning(out);
        }
        out.probs.forEach((p, i) => {
          fill(document.querySelector(`#patch-table td[data-layer="${out.layer}"][data-pos="${out.start + i}"]`), p, out);
          filled.push([out.layer, out.start + i, p]);
        });
        answerInView();  // the cells widen as they fill: the answer's column kept in view
        done += out.probs.length;
        if (!out.next) break;
        $("#patch-result").textContent = `full map: ${done} of ${total} patches (${Math.floor(100 * done / total)}%)…`;
        Object.assign(ask, out.next);
      }
    } catch (err) {
      if (err.name !== "AbortError") failed("patch", err.message);
      return;
    }
    answerInView();
    const csv = [["layer", "position", "clean_token", "corrupt_token", "p_target", "share_recovered"],
      ...filled.map(([l, t, p]) => [`h${l}`, t, out.clean_tokens[t], out.corrupt_tokens[t], p, (p - out.corrupt_prob) / out.gap])];
    $("#patch-result").replaceChildren(
      `full map: p(${shown(out.target)}) at the last position with the clean h_l copied in at each (layer, position); clean ${pct(out.clean_prob)}, corrupt ${pct(out.corrupt_prob)} (colour: the share of the gap recovered) `,
      el("a", { class: "csv small", id: "patch-csv", download: "lensdiv-patch-map.csv", href: csvHref(csv), title: "download the map as CSV" }, "CSV"));
  }

  function patchExample(info) {  // the session's example pair: one where patching moves the answer
    const example = info.patch_example;
    if (!example) return;
    $("#clean").value = example.clean;
    $("#corrupt").value = example.corrupt;
    $("#target").value = example.target;
    $("#patch-about").textContent = `The example: ${example.about}.`;
  }

  function pairChanged() {  // another pair: the example's target and words no longer apply
    const example = state.info.patch_example || {};
    const same = $("#clean").value === example.clean && $("#corrupt").value === example.corrupt;
    $("#target").value = same ? example.target : "";
    $("#patch-about").textContent = same ? `The example: ${example.about}.` :
      "Your own pair: the target is the clean prompt's top prediction unless you type one.";
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
    if (name === "patch") answerInView();
    if (name === "lens" && state.relayout) state.relayout();
  }

  async function start() {
    try {
      state.info = await api("api/info");
    } catch (err) { showError("", err.message); return; }
    const info = state.info;
    $("#model").textContent = `${info.model} · ${info.n_layers} blocks · d_model ${info.d_model} · context ${info.n_ctx}`;
    $("#legend-top").replaceChildren(`h${info.n_layers}`);
    $("#min-gap").textContent = `${100 * info.min_gap}`;
    info.lenses.forEach((name, i) => {
      const box = el("input", { type: "checkbox", value: name });
      box.checked = i === 0;
      box.addEventListener("change", refresh);
      $("#lenses").append(el("label", { title: name }, box, ` ${lensName(name)}`));
    });
    for (let b = 0; b < info.n_layers; b++) $("#skip-block").append(el("option", { value: b }, `block ${b}`));
    info.parts.forEach((p) => $("#skip-part").append(el("option", { value: p }, p)));
    $("#prompt").addEventListener("input", () => { state.follow = true; schedule(); });
    $("#grid-first").addEventListener("click", () => scrollGrids(false));
    $("#grid-last").addEventListener("click", () => scrollGrids(true));
    window.addEventListener("resize", () => { if (state.relayout) state.relayout(); answerInView(); });
    patchExample(info);
    ["#skip-block", "#skip-part", "#top-k"].forEach((s) => $(s).addEventListener("change", refresh));
    document.querySelectorAll(".tab").forEach((b) => b.addEventListener("click", () => tab(b.dataset.tab)));
    $("#patch-map").addEventListener("click", patchMap);
    ["#clean", "#corrupt"].forEach((s) => $(s).addEventListener("change", () => { pairChanged(); patchSetup(); }));
    $("#target").addEventListener("change", patchSetup);
    const tabName = fromLink(info);
    refresh();
    if (tabName !== "lens") tab(tabName);
  }

  // A link may open the page on a prompt (the course prints such links): ?text=…&skip=N&part=…
  // for the lens tab, ?clean=…&corrupt=…&target=…&tab=patch for the patch tab. A value the page
  // cannot use is named in a note, not dropped in silence.
  function fromLink(info) {
    const ask = new URLSearchParams(location.search);
    const ignored = [];
    const choose = (name, select, allowed, why) => {
      if (!ask.has(name)) return;
      const value = ask.get(name);
      if (allowed.includes(value)) $(select).value = value;
      else ignored.push(`${name}=${value} (${why})`);
    };
    if (ask.has("text")) $("#prompt").value = ask.get("text");
    const blocks = [...Array(info.n_layers).keys()].map(String);
    choose("skip", "#skip-block", blocks, `this model's blocks are 0-${info.n_layers - 1}`);
    choose("part", "#skip-part", info.parts, `use ${info.parts.join(", ")}`);
    choose("top_k", "#top-k", [...$("#top-k").options].map((o) => o.value), "use 3, 5 or 10");
    if (ask.has("clean")) $("#clean").value = ask.get("clean");
    if (ask.has("corrupt")) $("#corrupt").value = ask.get("corrupt");
    if (ask.has("clean") || ask.has("corrupt")) pairChanged();  // the example's target is not theirs
    if (ask.has("target")) $("#target").value = ask.get("target");
    let tabName = "lens";
    if (ask.has("tab")) {
      if (["lens", "patch", "runs"].includes(ask.get("tab"))) tabName = ask.get("tab");
      else ignored.push(`tab=${ask.get("tab")} (use lens, patch or runs)`);
    }
    const note = $("#notice");
    note.hidden = ignored.length === 0;
    note.textContent = ignored.length ? `This link's ${ignored.join("; ")} ${ignored.length === 1 ? "was" : "were"} ignored.` : "";
    return tabName;
  }

  function lensName(spec) {  // a fitted lens by its file's name (the whole path on hover)
    const m = /^([\w-]+):(.+)$/.exec(spec);
    if (!m || !/[\/\\]/.test(m[2])) return spec;
    const parts = m[2].split(/[\/\\]/).filter(Boolean);
    return `${m[1]}: ${parts[parts.length - 1] || m[2]}`;
  }
  start();
})();
