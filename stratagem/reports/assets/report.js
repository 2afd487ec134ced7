/* stratagem report: builds the plots, plan cards, plan explorer and table sorting from the embedded data.
   No network access; every data string reaches the page through text nodes (never innerHTML). */
(function () {
  "use strict";

  // ---------- DOM helpers ----------
  function h(tag, attrs) {
    var el = document.createElement(tag);
    if (attrs) {
      for (var k in attrs) {
        if (!Object.prototype.hasOwnProperty.call(attrs, k) || attrs[k] == null) continue;
        if (k === "text") el.textContent = attrs[k];
        else if (k === "style") el.setAttribute("style", attrs[k]);
        else if (k.slice(0, 2) === "on") el.addEventListener(k.slice(2), attrs[k]);
        else el.setAttribute(k, attrs[k]);
      }
    }
    for (var i = 2; i < arguments.length; i++) {
      var c = arguments[i];
      if (c == null) continue;
      if (Array.isArray(c)) c.forEach(function (x) { if (x != null) el.appendChild(typeof x === "string" ? document.createTextNode(x) : x); });
      else el.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    }
    return el;
  }
  function fmt(x, d) {
    if (x == null || !isFinite(x)) return "–";
    return Number(x).toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d });
  }
  function pct(x, d) { return x == null ? "–" : fmt(100 * x, d == null ? 1 : d) + "%"; }
  // Plotly reads a few tags in hover text; escape data so it stays text there too.
  function plotlyText(s) { return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;"); }

  // ---------- data ----------
  function decode(el) {
    var bin = atob(el.textContent.trim());
    var bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Response(stream).text().then(JSON.parse);
  }

  var D, P, F;  // payload, plans, field names
  function rec(row, names) {  // array row -> object
    if (!row) return null;
    var o = {};
    names.forEach(function (n, i) { o[n] = row[i]; });
    return o;
  }
  function planObj(i) { return rec(P.plan[i], F.plan); }
  function memObj(row) { return rec(row, F.mem); }

  // ---------- plots ----------
  var COLORS = { front: "#c0392b", feasible: "#2e86c1", infeasible: "#9aa0a6" };
  function hoverText(i) {
    var v = P.values[i], lines = ["<b>" + plotlyText(P.label[i]) + "</b>"];
    if (v) {
      lines.push("tokens/s " + fmt(v[0], 0));
      lines.push("headroom " + fmt(v[1], 2) + " GiB");
      lines.push("checkpoint goodput loss " + pct(v[2], 2));
    }
    lines.push((P.measured[i] ? "measured" : "analytic") + ", trial " + P.trial[i]);
    if (!P.feasible[i]) lines.push("not feasible: " + plotlyText(P.why[i]));
    return lines.join("<br>");
  }
  function groups() {
    var g = { infeasible: [], feasible: [], front: [] };
    for (var i = 0; i < P.label.length; i++) {
      if (!P.values[i]) continue;
      if (P.front[i]) g.front.push(i); else if (P.feasible[i]) g.feasible.push(i); else g.infeasible.push(i);
    }
    return g;
  }
  var GL_POINTS = 2000;  // above this many points the 2D views draw with WebGL (SVG gets slow)
  function traces(xk, yk, zk) {
    var g = groups(), out = [], many = g.infeasible.length + g.feasible.length + g.front.length > GL_POINTS && hasWebGL();
    [["infeasible", "not feasible", 0.25, 5], ["feasible", "feasible", 0.55, 6], ["front", "Pareto front", 1, 10]].forEach(function (t) {
      var idx = g[t[0]];
      var tr = {
        type: zk != null ? "scatter3d" : many ? "scattergl" : "scatter", mode: "markers", name: t[1] + " (" + idx.length + ")",
        x: idx.map(function (i) { return P.values[i][xk]; }),
        y: idx.map(function (i) { return P.values[i][yk]; }),
        text: idx.map(hoverText), customdata: idx, hovertemplate: "%{text}<extra></extra>",
        marker: {
          color: COLORS[t[0]], opacity: t[2], size: zk == null ? t[3] : t[3] * 0.6,
          symbol: idx.map(function (i) { return P.measured[i] ? "diamond" : "circle"; }),
          line: { width: t[0] === "front" ? 1 : 0, color: "#222" }
        }
      };
      if (zk != null) tr.z = idx.map(function (i) { return P.values[i][zk]; });
      // Plans that do not fit can sit thousands of GiB below zero headroom and squash the front into a line:
      // they start hidden (axes autorange over visible traces only) and one click on their legend entry shows them.
      if (t[0] === "infeasible" && g.feasible.length + g.front.length > 0) tr.visible = "legendonly";
      out.push(tr);
    });
    return out;
  }
  var AXIS = ["tokens/s (cluster)", "memory headroom (GiB)", "checkpoint goodput loss (fraction)"];
  function plot2d(id, xk, yk) {
    var el = document.getElementById(id);
    if (!el) return;
    Plotly.newPlot(el, traces(xk, yk), {
      margin: { l: 70, r: 20, t: 10, b: 50 }, hovermode: "closest", legend: { orientation: "h", y: -0.2 },
      xaxis: { title: { text: AXIS[xk] }, zeroline: false }, yaxis: { title: { text: AXIS[yk] } }
    }, { displaylogo: false, responsive: true });
    el.on("plotly_click", function (ev) { if (ev.points.length) Explorer.show(ev.points[0].customdata, true); });
  }
  var webgl = null;
  function hasWebGL() {
    if (webgl === null) { var c = document.createElement("canvas"); webgl = !!(c.getContext("webgl") || c.getContext("experimental-webgl")); }
    return webgl;
  }
  function plot3d(id) {  // drawn when it scrolls into view: a 3D scene of many points takes a while
    var el = document.getElementById(id);
    if (!el) return;
    if (!hasWebGL()) {
      el.appendChild(h("p", { class: "note", text: "The 3D view needs WebGL, which this browser does not offer; the two 2D views show the same points." }));
      return;
    }
    if (!("IntersectionObserver" in window)) { draw3d(el); return; }
    var io = new IntersectionObserver(function (entries) {
      if (entries.some(function (e) { return e.isIntersecting; })) { io.disconnect(); draw3d(el); }
    });
    io.observe(el);
  }
  function draw3d(el) {
    Plotly.newPlot(el, traces(1, 2, 0), {
      margin: { l: 0, r: 0, t: 0, b: 0 }, legend: { orientation: "h" },
      scene: { xaxis: { title: { text: "headroom GiB" } }, yaxis: { title: { text: "goodput loss" } }, zaxis: { title: { text: "tokens/s" } } }
    }, { displaylogo: false, responsive: true });
    el.on("plotly_click", function (ev) { if (ev.points.length) Explorer.show(ev.points[0].customdata, true); });
    el.setAttribute("data-drawn", "1");
  }

  // ---------- one plan: memory stack, time, zones, advice, predicted vs measured ----------
  var BLOCK_COLORS = { weights: "#1f77b4", gradients: "#ff7f0e", optimizer: "#2ca02c", activations: "#d62728", transient: "#9467bd", overhead: "#8c564b" };
  function memoryStack(mem) {
    if (!mem) return h("p", { class: "note", text: "No memory figures (the plan breaks a validity rule)." });
    var scale = Math.max(mem.peak_gib, mem.hbm_gib) * 1.04;
    var bar = h("div", { class: "stack", role: "img", "aria-label": "memory stack against HBM" });
    D.blocks.forEach(function (b) {
      var g = mem[b + "_gib"];
      if (g > 0) bar.appendChild(h("div", { class: "seg", style: "width:" + (100 * g / scale) + "%;background:" + BLOCK_COLORS[b], title: b + " " + fmt(g, 2) + " GiB" }));
    });
    bar.appendChild(h("div", { class: "hbm-line", style: "left:" + (100 * mem.hbm_gib / scale) + "%", title: "HBM " + fmt(mem.hbm_gib, 1) + " GiB" }));
    var rows = D.blocks.map(function (b) {
      var g = mem[b + "_gib"];
      return h("tr", { "data-block": b }, h("td", null, h("span", { class: "swatch", style: "background:" + BLOCK_COLORS[b] }), b,
        b === mem.first_block_to_break ? h("span", { class: "badge bad", text: "first to break" }) : null),
        h("td", { class: "num gib", text: fmt(g, 2) }), h("td", { class: "num", text: pct(g / mem.hbm_gib, 0) }));
    });
    var head = mem.headroom_gib;
    rows.push(h("tr", { class: "total" }, h("td", { text: "peak" }), h("td", { class: "num mem-peak", text: fmt(mem.peak_gib, 2) }), h("td", { class: "num", text: pct(mem.peak_gib / mem.hbm_gib, 0) })));
    rows.push(h("tr", null, h("td", { text: "HBM" }), h("td", { class: "num mem-hbm", text: fmt(mem.hbm_gib, 2) }), h("td", { class: "num", text: "100%" })));
    rows.push(h("tr", { class: head >= 0 ? "ok" : "bad" }, h("td", { text: "headroom" }), h("td", { class: "num mem-headroom", text: fmt(head, 2) }), h("td", { class: "num", text: pct(head / mem.hbm_gib, 0) })));
    return h("div", null, h("h4", { text: "Memory per GPU (worst rank, stage " + mem.worst_stage + ")" }), bar,
      h("table", { class: "mini" }, h("thead", null, h("tr", null, h("th", { text: "block" }), h("th", { text: "GiB" }), h("th", { text: "of HBM" }))), h("tbody", null, rows)));
  }
  var STEP_PARTS = [["compute_s", "compute", "#2e86c1"], ["recompute_s", "recompute", "#85c1e9"], ["exposed_comm_s", "exposed communication", "#e67e22"], ["bubble_s", "pipeline bubble", "#c0392b"], ["optimizer_s", "optimizer step", "#27ae60"]];
  var COMM_PARTS = [["tp_comm_s", "TP"], ["dp_comm_s", "DP/FSDP"], ["pp_comm_s", "PP"], ["cp_comm_s", "CP"]];
  function timeBreakdown(time, tput) {
    if (!time) return h("p", { class: "note", text: "No step-time figures for this plan." });
    var t = rec(time, F.time), sum = 0, bar = h("div", { class: "stack" });
    var rows = STEP_PARTS.map(function (p) {
      var v = t[p[0]] || 0; sum += v;
      if (v > 0) bar.appendChild(h("div", { class: "seg", style: "width:" + (100 * v / t.step_s) + "%;background:" + p[2], title: p[1] + " " + fmt(v, 3) + " s" }));
      return h("tr", null, h("td", null, h("span", { class: "swatch", style: "background:" + p[2] }), p[1]), h("td", { class: "num", text: fmt(v, 3) }), h("td", { class: "num", text: pct(v / t.step_s, 1) }));
    });
    var other = t.step_s - sum;
    if (Math.abs(other) > 1e-6 * t.step_s) rows.push(h("tr", null, h("td", { text: "other (step minus the parts above)" }), h("td", { class: "num", text: fmt(other, 3) }), h("td", { class: "num", text: pct(other / t.step_s, 1) })));
    rows.push(h("tr", { class: "total" }, h("td", { text: "step" }), h("td", { class: "num step-s", text: fmt(t.step_s, 3) }), h("td", { class: "num", text: "100%" })));
    var comm = COMM_PARTS.map(function (p) { return p[1] + " " + fmt(t[p[0]], 3) + " s"; }).join(", ");
    var u = rec(tput, F.tput);
    return h("div", null, h("h4", { text: "Step time" }), bar,
      h("table", { class: "mini" }, h("thead", null, h("tr", null, h("th", { text: "part" }), h("th", { text: "s" }), h("th", { text: "of step" }))), h("tbody", null, rows)),
      h("p", { class: "note", text: "Communication before overlap: " + comm + "." }),
      u ? h("p", { text: "Throughput " + fmt(u.tokens_per_s, 0) + " tokens/s (" + fmt(u.tokens_per_s_per_gpu, 0) + " per GPU), MFU " + pct(u.mfu, 1) + "." }) : null);
  }
  function checkpointLine(ckpt) {
    var c = rec(ckpt, F.ckpt);
    if (!c) return null;
    return h("p", { class: "ckpt", text: "Checkpoint: " + fmt(c.state_gib, 1) + " GiB state, save " + fmt(c.save_s, 1) + " s (stall " + fmt(c.stall_s, 1) + " s), every " + fmt(c.interval_s / 60, 1) + " min; job MTBF " + fmt(c.job_mtbf_h, 1) + " h; expected goodput loss " + pct(c.goodput_loss, 2) + "." });
  }
  var ZONE_TITLES = { hbm: "HBM", communication: "communication", bubbles: "pipeline bubbles", checkpoint: "checkpoint I/O" };
  function zonesView(z) {
    if (!z) return h("p", { class: "note", text: "No zone verdicts for this plan." });
    var bottleneck = z[4];
    return h("div", null, h("h4", { text: "Zones" }), h("table", { class: "mini zones" }, h("tbody", null, F.zones.map(function (name, k) {
      var zz = z[k];
      return h("tr", { class: name === bottleneck ? "bottleneck" : null, "data-zone": name },
        h("td", { text: ZONE_TITLES[name] + (name === bottleneck ? " (bottleneck)" : "") }),
        h("td", null, h("span", { class: "badge " + zz[0], text: zz[0] })),
        h("td", { class: "num", text: fmt(zz[1], 3) }), h("td", { text: zz[2] }));
    }))));
  }
  var labels = null;
  function labelIndex() {  // plan label -> index, to link advice to neighbours the study evaluated
    if (!labels) { labels = {}; P.label.forEach(function (l, i) { if (!(l in labels)) labels[l] = i; }); }
    return labels;
  }
  function adviceView(i) {
    var a = P.advice[String(i)];
    if (!a) return h("div", null, h("h4", { text: "Advice" }), h("p", { class: "note", text: P.status[i] === "infeasible" ?
      "No advice: the plan breaks a validity rule (see above)." :
      "This report computed advice for its " + D.advice_limit + " leading plans (the front first); for this one run: stratagem explain SCENARIO.yaml --plan " + P.key[i] }));
    if (!a.length) return h("div", null, h("h4", { text: "Advice" }), h("p", { text: "Nothing to change: no zone calls for a neighbouring plan." }));
    return h("div", null, h("h4", { text: "Advice" }), h("ul", { class: "advice" }, a.map(function (x) {
      var j = x[2] ? labelIndex()[x[2]] : undefined, target = null;
      if (x[2]) target = j === undefined ? h("span", { class: "plan-label", text: " → " + x[2] }) :
        h("span", null, " → ", h("button", { type: "button", class: "near plan-label", title: "evaluated in this study: open it in the explorer", onclick: function () { Explorer.show(j, true); }, text: x[2] }));
      return h("li", null, h("span", { class: "badge zone", text: ZONE_TITLES[x[0]] || x[0] }), " ", x[1], target, x[3] ? h("span", { class: "effect", text: " (" + x[3] + ")" }) : null);
    })));
  }
  function predictedVsMeasured(i) {
    var pr = P.prediction[String(i)];
    if (!P.measured[i] || !pr) return null;
    var rows = [], mm = memObj(P.mem[i]), pm = memObj(pr.mem), mt = rec(P.time[i], F.time), pt = rec(pr.time, F.time), mu = rec(P.tput[i], F.tput), pu = rec(pr.tput, F.tput);
    function add(name, p, m, d) {
      if (p == null && m == null) return;
      var err = p != null && m != null && m !== 0 ? (p - m) / m : null;
      rows.push(h("tr", null, h("td", { text: name }), h("td", { class: "num", text: fmt(p, d) }), h("td", { class: "num", text: fmt(m, d) }), h("td", { class: "num", text: err == null ? "–" : (err >= 0 ? "+" : "") + pct(err, 1) })));
    }
    add("peak memory GiB", pm && pm.peak_gib, mm && mm.peak_gib, 2);
    add("step time s", pt && pt.step_s, mt && mt.step_s, 3);
    add("tokens/s", pu && pu.tokens_per_s, mu && mu.tokens_per_s, 0);
    add("MFU", pu && pu.mfu, mu && mu.mfu, 3);
    return h("div", null, h("h4", { text: "Predicted vs measured" }), h("table", { class: "mini pvm" },
      h("thead", null, h("tr", null, h("th", { text: "figure" }), h("th", { text: "predicted" }), h("th", { text: "measured" }), h("th", { text: "prediction error" }))), h("tbody", null, rows)));
  }
  function planView(i) {
    var head = h("div", { class: "plan-head" }, h("strong", { class: "plan-label", text: P.label[i] }), " ",
      h("span", { class: "badge " + (P.measured[i] ? "measured" : "analytic"), text: P.measured[i] ? "measured" : "analytic" }), " ",
      h("span", { class: "badge " + (P.feasible[i] ? "ok" : "bad"), text: P.feasible[i] ? "feasible" : P.status[i] }),
      h("span", { class: "note", text: " trial " + P.trial[i] + ", " + P.key[i] }));
    return h("div", { class: "plan-view" }, head, P.feasible[i] ? null : h("p", { class: "why", text: "Not feasible: " + P.why[i] }),
      h("div", { class: "cols" }, memoryStack(memObj(P.mem[i])), timeBreakdown(P.time[i], P.tput[i])),
      checkpointLine(P.ckpt[i]), zonesView(P.zones[i]), adviceView(i), predictedVsMeasured(i));
  }

  // ---------- cards of the front (rendered when opened) ----------
  function cards() {
    document.querySelectorAll("details.card").forEach(function (d) {
      var fill = function () { if (!d.dataset.filled) { d.dataset.filled = "1"; d.appendChild(planView(+d.dataset.plan)); } };
      if (d.open) fill();
      d.addEventListener("toggle", fill);
    });
  }

  // ---------- plan explorer ----------
  var Explorer = {
    index: {}, axes: [], selects: {},
    keyOf: function (i) { var p = planObj(i); return Explorer.axes.map(function (a) { return String(p[a]); }).join("|"); },
    init: function () {
      var root = document.getElementById("explorer");
      if (!root || !P.label.length) return;
      Explorer.axes = D.explorer_axes;
      var values = {};
      Explorer.axes.forEach(function (a) { values[a] = {}; });
      for (var i = 0; i < P.label.length; i++) {
        var p = planObj(i), k = Explorer.keyOf(i);
        (Explorer.index[k] = Explorer.index[k] || []).push(i);
        Explorer.axes.forEach(function (a) { values[a][String(p[a])] = p[a]; });
      }
      var controls = h("div", { class: "controls" });
      Explorer.axes.forEach(function (a) {
        var opts = Object.keys(values[a]).map(function (s) { return values[a][s]; });
        opts.sort(function (x, y) { return typeof x === "number" ? x - y : String(x) < String(y) ? -1 : 1; });
        var sel = h("select", { name: a, id: "ex-" + a, onchange: Explorer.update }, opts.map(function (v) { return h("option", { value: String(v), text: String(v) }); }));
        Explorer.selects[a] = sel;
        controls.appendChild(h("label", null, a.replace(/_/g, " "), sel));
      });
      root.appendChild(controls);
      root.appendChild(h("div", { id: "explorer-status", class: "status", "aria-live": "polite" }));
      root.appendChild(h("div", { id: "explorer-plan" }));
      var start = D.front.length ? D.front[0] : 0;
      Explorer.show(start, false);
    },
    show: function (i, scroll) {
      var p = planObj(i);
      Explorer.axes.forEach(function (a) { Explorer.selects[a].value = String(p[a]); });
      Explorer.render(i);
      if (scroll) document.getElementById("explorer").scrollIntoView({ behavior: "smooth" });
    },
    update: function () {
      var k = Explorer.axes.map(function (a) { return Explorer.selects[a].value; }).join("|");
      var hits = Explorer.index[k];
      if (hits && hits.length) {
        hits = hits.slice().sort(function (x, y) { return (P.feasible[y] - P.feasible[x]) || ((P.values[y] ? P.values[y][0] : -1) - (P.values[x] ? P.values[x][0] : -1)); });
        Explorer.render(hits[0], hits);
      } else Explorer.missing(k);
    },
    render: function (i, hits) {
      hits = hits || Explorer.index[Explorer.keyOf(i)] || [i];
      var status = document.getElementById("explorer-status"), out = document.getElementById("explorer-plan");
      status.textContent = "";
      if (hits.length > 1) {
        var sel = h("select", { id: "ex-variant", onchange: function () { Explorer.render(+this.value, hits); } }, hits.map(function (j) { return h("option", { value: String(j), text: P.label[j] + (P.feasible[j] ? "" : " (not feasible)") }); }));
        sel.value = String(i);
        status.appendChild(h("label", null, hits.length + " evaluated plans share these settings (they differ in cp, sp, schedule, offload...): ", sel));
      } else status.appendChild(h("span", { text: "Evaluated plan" + (P.front[i] ? " on the Pareto front." : ".") }));
      out.replaceChildren(planView(i));
    },
    missing: function (k) {
      var want = k.split("|"), near = [];
      for (var key in Explorer.index) {
        var parts = key.split("|"), diff = 0;
        for (var t = 0; t < parts.length; t++) if (parts[t] !== want[t]) diff++;
        if (diff === 1) near.push(Explorer.index[key][0]);
      }
      var status = document.getElementById("explorer-status");
      status.replaceChildren(h("span", null,
        h("strong", { class: "not-evaluated", text: "This combination was not evaluated in this study" }),
        " (the search did not store it: it breaks a validity rule, or was screened out without being kept). ",
        near.length ? "Evaluated neighbours, one setting away: " : "No evaluated plan is one setting away.",
        near.slice(0, 8).map(function (j) { return h("button", { type: "button", class: "near", onclick: function () { Explorer.show(j, false); }, text: P.label[j] }); })));
      document.getElementById("explorer-plan").replaceChildren();
    }
  };

  // ---------- sortable tables ----------
  function sortable() {
    document.querySelectorAll("table.sortable").forEach(function (table) {
      table.querySelectorAll("th").forEach(function (th, col) {
        th.addEventListener("click", function () {
          var asc = th.getAttribute("aria-sort") !== "ascending";
          table.querySelectorAll("th").forEach(function (o) { o.removeAttribute("aria-sort"); });
          th.setAttribute("aria-sort", asc ? "ascending" : "descending");
          var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows), num = th.dataset.type === "num";
          rows.sort(function (a, b) {
            var x = a.cells[col].dataset.v != null ? a.cells[col].dataset.v : a.cells[col].textContent;
            var y = b.cells[col].dataset.v != null ? b.cells[col].dataset.v : b.cells[col].textContent;
            var c = num ? (parseFloat(x) - parseFloat(y)) : x.localeCompare(y);
            return asc ? c : -c;
          });
          rows.forEach(function (r) { body.appendChild(r); });
        });
      });
    });
    document.querySelectorAll("table.front tr[data-plan]").forEach(function (tr) {
      tr.addEventListener("dblclick", function () { Explorer.show(+tr.dataset.plan, true); });
    });
  }

  // ---------- capacity ----------
  function capacityPlot() {
    var el = document.getElementById("capacity-plot"), c = D.capacity;
    if (!el || !c || !c.nodes.length) return;
    var text = c.nodes.map(function (n, k) { return n + " nodes (" + c.gpus[k] + " GPUs): " + plotlyText(c.label[k]); });
    Plotly.newPlot(el, [
      { type: "scatter", mode: "lines+markers", name: "days to train", x: c.nodes, y: c.days, text: text, hovertemplate: "%{text}<br>%{y:.1f} days<extra></extra>" },
      { type: "scatter", mode: "lines+markers", name: "cost (" + c.currency + ")", x: c.nodes, y: c.cost, yaxis: "y2", text: text, hovertemplate: "%{text}<br>%{y:,.0f} " + c.currency + "<extra></extra>" }
    ], {
      margin: { l: 70, r: 80, t: 10, b: 50 }, legend: { orientation: "h", y: -0.25 },
      xaxis: { title: { text: "nodes" }, type: "log", tickvals: c.nodes },
      yaxis: { title: { text: "days to train" } }, yaxis2: { title: { text: "cost (" + c.currency + ")" }, overlaying: "y", side: "right" }
    }, { displaylogo: false, responsive: true });
  }

  function start() {
    var el = document.getElementById("stratagem-data");
    decode(el).then(function (data) {
      D = data; P = D.plans; F = D.fields;
      var mark = function (m) { if (window.performance && performance.mark) performance.mark("stratagem:" + m); };
      mark("decoded");
      sortable();
      capacityPlot();
      if (P) {  // absent on a capacity-only page
        Explorer.init(); mark("explorer");
        cards(); mark("cards");
        plot2d("plot-headroom", 1, 0); mark("plot-headroom");
        plot2d("plot-risk", 2, 0); mark("plot-risk");
        plot3d("plot-3d"); mark("plot-3d");
      }
      document.body.setAttribute("data-ready", "1");
    }).catch(function (e) {
      document.body.insertBefore(h("p", { class: "why", text: "The report's data could not be read: " + e }), document.body.firstChild);
      throw e;
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
})();
