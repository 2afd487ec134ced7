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
  // The one rule for numbers (stratagem/quantities.py): 3 significant figures, memory in the binary unit of the
  // largest figure shown together, one duration unit per card, fractions as percentages.
  function sig(x, n) {
    if (x == null || !isFinite(x)) return "–";
    if (x === 0) return "0";
    n = n || 3;
    var r = Number(Number(x).toPrecision(n)), mag = Math.floor(Math.log10(Math.abs(r)));
    var d = Math.max(0, n - 1 - mag);  // trailing zeros kept, as quantities.sig
    return r.toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d });
  }
  function percent(x) { return x == null || !isFinite(x) ? "–" : sig(100 * x) + "%"; }
  var MEM_UNITS = [["B", 1], ["KiB", 1024], ["MiB", 1048576], ["GiB", 1073741824], ["TiB", 1099511627776]];
  function memUnit(gibs) {  // [name, bytes per unit] for GiB figures shown together
    var big = 0, u = MEM_UNITS[0];
    gibs.forEach(function (g) { if (g != null && isFinite(g)) big = Math.max(big, Math.abs(g)); });
    MEM_UNITS.forEach(function (m) { if (big * 1073741824 >= m[1] * (1 - 5e-4)) u = m; });
    return u;
  }
  function memIn(g, u) { return g == null || !isFinite(g) ? "–" : sig(g * 1073741824 / u[1]); }
  var DUR_UNITS = [["ms", 1e-3], ["s", 1], ["min", 60], ["h", 3600], ["days", 86400]];
  function durUnit(secs) {
    var big = 0, u = DUR_UNITS[1];
    secs.forEach(function (x) { if (x != null && isFinite(x) && Math.abs(x) >= 1e-9) big = Math.max(big, Math.abs(x)); });
    DUR_UNITS.forEach(function (d) { if (big >= d[1] * (d[1] > 1 ? 2 : 1)) u = d; });
    if (big > 0 && big < 1) u = DUR_UNITS[0];
    return u;
  }
  var TIME_FLOOR_S = 1e-9;  // quantities.TIME_FLOOR_S: below a nanosecond a duration is round-off and prints 0
  function durIn(x, u) { return x == null || !isFinite(x) ? "–" : Math.abs(x) < TIME_FLOOR_S ? "0" : sig(x / u[1]); }
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
  function newPlot(el, data, layout) { return Plotly.newPlot(el, data, layout, { displaylogo: false, responsive: true }); }
  var COLORS = { front: "#c0392b", feasible: "#2e86c1", infeasible: "#9aa0a6" };
  function hoverText(i) {
    var v = P.values[i], lines = ["<b>" + plotlyText(P.label[i]) + "</b>"];
    if (v) {
      var hu = memUnit([v[1]]);
      lines.push("tokens/s " + sig(v[0]));
      lines.push("headroom " + memIn(v[1], hu) + " " + hu[0]);
      lines.push("checkpoint goodput loss " + percent(v[2]));
    }
    lines.push((P.measured[i] ? "measured" : "analytic") + ", trial " + P.trial[i]);
    if (!P.feasible[i]) lines.push("not feasible: " + plotlyText(P.why[i]));
    return lines.join("<br>");
  }
  function groups() {
    var g = { infeasible: [], feasible: [], front: [], unplotted: 0 };
    for (var i = 0; i < P.label.length; i++) {
      if (!P.values[i]) { g.unplotted++; continue; }
      if (P.front[i]) g.front.push(i); else if (P.feasible[i]) g.feasible.push(i); else g.infeasible.push(i);
    }
    return g;
  }
  var GL_POINTS = 2000;  // above this many points the 2D views draw with WebGL (SVG gets slow)
  function traces(xk, yk, zk) {
    var g = groups(), out = [], many = g.infeasible.length + g.feasible.length + g.front.length > GL_POINTS && hasWebGL();
    [["infeasible", "not feasible", 0.25, 5], ["feasible", "feasible", 0.55, 6], ["front", "Pareto front", 1, 10]].forEach(function (t) {
      var idx = g[t[0]];
      // the plans without objective values (a broken rule, a failed run) are not drawn: the legend says how many,
      // so the counts add up to the page's distinct plans
      var extra = t[0] === "infeasible" && g.unplotted ? "; " + g.unplotted + " more without figures, not drawn" : "";
      var tr = {
        type: zk != null ? "scatter3d" : many ? "scattergl" : "scatter", mode: "markers", name: t[1] + " (" + idx.length + extra + ")",
        x: idx.map(function (i) { return axisValue(xk, P.values[i][xk]); }),
        y: idx.map(function (i) { return axisValue(yk, P.values[i][yk]); }),
        text: idx.map(hoverText), customdata: idx, hovertemplate: "%{text}<extra></extra>",
        marker: {
          color: COLORS[t[0]], opacity: t[2], size: zk == null ? t[3] : t[3] * 0.6,
          symbol: idx.map(function (i) { return P.measured[i] ? "diamond" : "circle"; }),
          line: { width: t[0] === "front" ? 1 : 0, color: "#222" }
        }
      };
      if (zk != null) tr.z = idx.map(function (i) { return axisValue(zk, P.values[i][zk]); });
      // Plans that do not fit can sit thousands of GiB below zero headroom and squash the front into a line:
      // they start hidden (axes autorange over visible traces only) and one click on their legend entry shows them.
      if (t[0] === "infeasible" && g.feasible.length + g.front.length > 0) tr.visible = "legendonly";
      out.push(tr);
    });
    return out;
  }
  // Axes by the one rule: headroom in the unit of the largest HBM among the plans (MiB for the CPU demo), the
  // checkpoint goodput loss as a percentage (stratagem/quantities.py).
  var AXIS_MEM = null;
  function axisMem() {
    if (AXIS_MEM === null) {
      var hbm = [];
      for (var i = 0; i < P.label.length; i++) { var m = P.mem[i] ? memObj(P.mem[i]) : null; if (m) hbm.push(m.hbm_gib); }
      AXIS_MEM = memUnit(hbm.length ? hbm : (P.values || []).map(function (v) { return v ? v[1] : null; }));
    }
    return AXIS_MEM;
  }
  function axisValue(k, v) {
    if (v == null || !isFinite(v)) return v;
    return k === 1 ? v * 1073741824 / axisMem()[1] : k === 2 ? 100 * v : v;
  }
  function axisTitle(k) {
    return ["tokens/s (cluster)", "memory headroom (" + axisMem()[0] + ")", "checkpoint goodput loss (%)"][k];
  }
  function plot2d(id, xk, yk) {
    var el = document.getElementById(id);
    if (!el) return;
    newPlot(el, traces(xk, yk), {
      margin: { l: 70, r: 20, t: 10, b: 50 }, hovermode: "closest", legend: { orientation: "h", y: -0.2 },
      xaxis: { title: { text: axisTitle(xk) }, zeroline: false }, yaxis: { title: { text: axisTitle(yk) } }
    });
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
    newPlot(el, traces(1, 2, 0), {
      margin: { l: 0, r: 0, t: 0, b: 0 }, legend: { orientation: "h" },
      scene: { xaxis: { title: { text: axisTitle(1) } }, yaxis: { title: { text: axisTitle(2) } }, zaxis: { title: { text: axisTitle(0) } } }
    });
    el.on("plotly_click", function (ev) { if (ev.points.length) Explorer.show(ev.points[0].customdata, true); });
    el.setAttribute("data-drawn", "1");
  }

  // ---------- one plan: memory stack, time, zones, advice, predicted vs measured ----------
  var BLOCK_COLORS = { weights: "#1f77b4", gradients: "#ff7f0e", optimizer: "#2ca02c", activations: "#d62728", transient: "#9467bd", overhead: "#8c564b" };
  function memoryStack(mem) {
    if (!mem) return h("p", { class: "note", text: "No memory figures (the plan breaks a validity rule)." });
    var scale = Math.max(mem.peak_gib, mem.hbm_gib) * 1.04, u = memUnit([mem.peak_gib, mem.hbm_gib]);
    var bar = h("div", { class: "stack", role: "img", "aria-label": "memory stack against HBM" });
    D.blocks.forEach(function (b) {
      var g = mem[b + "_gib"];
      if (g > 0) bar.appendChild(h("div", { class: "seg", style: "width:" + (100 * g / scale) + "%;background:" + BLOCK_COLORS[b], title: b + " " + memIn(g, u) + " " + u[0] }));
    });
    bar.appendChild(h("div", { class: "hbm-line", style: "left:" + (100 * mem.hbm_gib / scale) + "%", title: "HBM " + memIn(mem.hbm_gib, u) + " " + u[0] }));
    var rows = D.blocks.map(function (b) {
      var g = mem[b + "_gib"];
      return h("tr", { "data-block": b }, h("td", null, h("span", { class: "swatch", style: "background:" + BLOCK_COLORS[b] }), b,
        b === mem.first_block_to_break ? h("span", { class: "badge bad", text: "first to break" }) : null),
        h("td", { class: "num gib", text: memIn(g, u) }), h("td", { class: "num", text: percent(g / mem.hbm_gib) }));
    });
    var head = mem.headroom_gib;
    rows.push(h("tr", { class: "total" }, h("td", { text: "peak" }), h("td", { class: "num mem-peak", text: memIn(mem.peak_gib, u) }), h("td", { class: "num", text: percent(mem.peak_gib / mem.hbm_gib) })));
    rows.push(h("tr", null, h("td", { text: "HBM" }), h("td", { class: "num mem-hbm", text: memIn(mem.hbm_gib, u) }), h("td", { class: "num", text: "100%" })));
    rows.push(h("tr", { class: head >= 0 ? "ok" : "bad" }, h("td", { text: "headroom" }), h("td", { class: "num mem-headroom", text: memIn(head, u) }), h("td", { class: "num", text: percent(head / mem.hbm_gib) })));
    return h("div", null, h("h4", { text: "Memory per GPU (worst rank, stage " + mem.worst_stage + ")" }), bar,
      h("table", { class: "mini" }, h("thead", null, h("tr", null, h("th", { text: "block" }), h("th", { text: u[0] }), h("th", { text: "of HBM" }))), h("tbody", null, rows)));
  }
  // the step-time parts come from the evaluators' table (D.step_parts: name, meaning, label, group, hidden, unit)
  var PART_COLORS = { compute_s: "#2e86c1", recompute_s: "#85c1e9", tp_comm_s: "#e67e22", ep_comm_s: "#d35400", cp_comm_s: "#f5b041", pp_comm_s: "#a04000", dp_comm_s: "#f0b27a", bubble_s: "#c0392b", optimizer_s: "#27ae60", overhead_s: "#95a5a6" };
  function stepTerms() { return D.step_parts.filter(function (p) { return p.meaning === "in_step" || p.meaning === "exposed"; }); }
  function beforeOverlap(t, p) { return (t[p.name] || 0) + (p.hidden ? (t[p.hidden] || 0) : 0); }
  function latestRun(i) {  // the latest real run of plan i with a measured step (D.runs), or null
    var R = D.runs, best = null;
    if (!R) return null;
    for (var k = 0; k < R.trial.length; k++) if (R.plan[k] === i && R.measured[k] != null) best = k;
    return best;
  }
  function stepUnit(i) {  // the one duration unit of a card's step figures: parts, measured step, predicted vs measured
    var secs = [], pr = P.prediction[String(i)], run = P.measured[i] ? latestRun(i) : null;
    [P.time[i], pr && pr.time].forEach(function (row) {
      var t = rec(row, F.time);
      if (t) { secs.push(t.step_s); D.step_parts.forEach(function (p) { if (p.meaning === "exposed") secs.push(beforeOverlap(t, p)); }); }
    });
    if (run != null) secs.push(D.runs.measured[run], D.runs.high[run]);
    return durUnit(secs);
  }
  function timeBreakdown(i) {
    var time = P.time[i], tput = P.tput[i], pr = P.prediction[String(i)], run = P.measured[i] ? latestRun(i) : null;
    var measuredLine = null, su = stepUnit(i);
    if (run != null) {
      var R = D.runs, mu = su;
      measuredLine = h("p", { class: "measured-step", text: "Measured step " + durIn(R.measured[run], mu) + " " + mu[0] +
        (R.low[run] != null ? " (95% interval " + durIn(R.low[run], mu) + "–" + durIn(R.high[run], mu) + " " + mu[0] + ", n=" + R.n[run] + ")" : "") +
        ", trial " + R.trial[run] + (time ? "." : "; the parts below are the prediction's (a run times whole steps only).") });
    }
    if (!time && pr && pr.time && P.measured[i]) time = pr.time;
    if (!time) return h("div", null, h("h4", { text: "Step time" }), measuredLine || h("p", { class: "note", text: "No step-time figures for this plan." }), throughputLine(tput));
    var t = rec(time, F.time), sum = 0, bar = h("div", { class: "stack" });
    var comms = D.step_parts.filter(function (p) { return p.meaning === "exposed"; });
    var rows = [];
    stepTerms().forEach(function (p) {  // as explain: the terms above 0.05 % of the step
      var v = t[p.name] || 0, color = PART_COLORS[p.name] || "#7f8c8d"; sum += v;
      if (!(v > 5e-4 * t.step_s)) return;
      bar.appendChild(h("div", { class: "seg", style: "width:" + (100 * v / t.step_s) + "%;background:" + color, title: p.label + " " + durIn(v, su) + " " + su[0] }));
      rows.push(h("tr", { "data-part": p.name }, h("td", null, h("span", { class: "swatch", style: "background:" + color }), p.label), h("td", { class: "num", text: durIn(v, su) }), h("td", { class: "num", text: percent(v / t.step_s) })));
    });
    var other = t.step_s - sum;
    if (Math.abs(other) > 1e-3 * t.step_s) rows.push(h("tr", null, h("td", { text: "other (step minus the parts above)" }), h("td", { class: "num", text: durIn(other, su) }), h("td", { class: "num", text: percent(other / t.step_s) })));
    rows.push(h("tr", { class: "total" }, h("td", { text: P.measured[i] && !P.time[i] ? "predicted step" : "step" }), h("td", { class: "num step-s", text: durIn(t.step_s, su) }), h("td", { class: "num", text: "100%" })));
    var comm = comms.map(function (p) { return h("span", { "data-part": p.name, text: p.group + " " + durIn(beforeOverlap(t, p), su) + " " + su[0] }); });
    var line = h("p", { class: "note comm-before-overlap" }, "Communication before overlap: ");
    comm.forEach(function (c, k) { if (k) line.appendChild(document.createTextNode(", ")); line.appendChild(c); });
    line.appendChild(document.createTextNode("."));
    return h("div", null, h("h4", { text: "Step time" }), measuredLine, bar,
      h("table", { class: "mini step-parts" }, h("thead", null, h("tr", null, h("th", { text: "part" }), h("th", { text: su[0] }), h("th", { text: "of step" }))), h("tbody", null, rows)),
      line, throughputLine(tput));
  }
  function throughputLine(tput) {
    var u = rec(tput, F.tput);
    return u ? h("p", { text: "Throughput " + sig(u.tokens_per_s) + " tokens/s (" + sig(u.tokens_per_s_per_gpu) + " per GPU), MFU " + percent(u.mfu) + "." }) : null;
  }
  function checkpointLine(ckpt) {
    var c = rec(ckpt, F.ckpt);
    if (!c) return null;
    var mu = memUnit([c.state_gib]), du = durUnit([c.save_s, c.stall_s, c.interval_s]);  // one unit per line
    var mtbfU = durUnit([c.job_mtbf_h * 3600]);  // in its own unit, as the checkpoint zone's sentence says it
    return h("p", { class: "ckpt", text: "Checkpoint: " + memIn(c.state_gib, mu) + " " + mu[0] + " state, save " + durIn(c.save_s, du) + " " + du[0] + " (stall " + durIn(c.stall_s, du) + " " + du[0] + "), every " + durIn(c.interval_s, du) + " " + du[0] + "; job MTBF " + durIn(c.job_mtbf_h * 3600, mtbfU) + " " + mtbfU[0] + "; expected goodput loss " + percent(c.goodput_loss) + "." });
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
    // advice reasons from the model (reports.advice.advice_for): a measured plan's effects start from its prediction
    var title = P.measured[i] ? D.advice_measured_title : "Advice";
    return h("div", null, h("h4", { text: title }), h("ul", { class: "advice" }, a.map(function (x) {
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
    var run = latestRun(i), mstep = mt ? mt.step_s : run != null ? D.runs.measured[run] : null;
    function add(name, p, m, show) {
      if (p == null && m == null) return;
      var err = p != null && m != null && m !== 0 ? (p - m) / m : null;
      rows.push(h("tr", null, h("td", { text: name }), h("td", { class: "num", text: show(p) }), h("td", { class: "num", text: show(m) }), h("td", { class: "num", text: err == null ? "–" : (err >= 0 ? "+" : "") + percent(err) })));
    }
    var ppeak = pm && pm.peak_gib, mpeak = mm && mm.peak_gib, u = memUnit([ppeak, mpeak]), pstep = pt && pt.step_s, su = stepUnit(i);
    add("peak memory " + u[0], ppeak, mpeak, function (x) { return memIn(x, u); });
    add("step time " + su[0], pstep, mstep, function (x) { return durIn(x, su); });
    add("tokens/s", pu && pu.tokens_per_s, mu && mu.tokens_per_s, sig);
    add("MFU", pu && pu.mfu, mu && mu.mfu, percent);
    return h("div", null, h("h4", { text: "Predicted vs measured" }), h("table", { class: "mini pvm" },
      h("thead", null, h("tr", null, h("th", { text: "figure" }), h("th", { text: "predicted" }), h("th", { text: "measured" }), h("th", { text: "prediction error" }))), h("tbody", null, rows)));
  }
  function planView(i) {
    var head = h("div", { class: "plan-head" }, h("strong", { class: "plan-label", text: P.label[i] }), " ",
      h("span", { class: "badge " + (P.measured[i] ? "measured" : "analytic"), text: P.measured[i] ? "measured" : "analytic" }), " ",
      h("span", { class: "badge " + (P.feasible[i] ? "ok" : "bad"), text: P.feasible[i] ? "feasible" : P.status[i] }),
      h("span", { class: "note", text: " trial " + P.trial[i] + ", " + P.key[i] }));
    return h("div", { class: "plan-view" }, head, P.feasible[i] ? null : h("p", { class: "why", text: "Not feasible: " + P.why[i] }),
      h("div", { class: "cols" }, memoryStack(memObj(P.mem[i])), timeBreakdown(i)),
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
    index: {}, axes: [], selects: {}, pinned: null, current: null,
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
      status.appendChild(h("button", { type: "button", id: "ex-pin", class: "pin", title: "keep this plan beside the explorer's to compare them",
        onclick: function () { Explorer.pinned = i; Explorer.render(i, hits); }, text: "pin to compare" }));
      Explorer.current = i;
      var p = Explorer.pinned;
      if (p == null || p === i) { out.replaceChildren(planView(i)); return; }
      // two plans in one view, as `stratagem compare`: the pinned one beside the explorer's, and which is faster
      var vp = P.values[p], vi = P.values[i], line = "";
      if (vp && vi && vp[0] > 0 && vi[0] > 0) {
        var fast = vp[0] >= vi[0] ? p : i, slow = fast === p ? i : p;
        line = P.label[fast] + " is " + percent(P.values[fast][0] / P.values[slow][0] - 1) + " faster than " + P.label[slow] + " (" + sig(P.values[fast][0]) + " vs " + sig(P.values[slow][0]) + " tokens/s).";
      }
      out.replaceChildren(h("p", { class: "pin-line" }, line + " ", h("button", { type: "button", id: "ex-unpin", class: "pin", onclick: function () { Explorer.pinned = null; Explorer.render(i, hits); }, text: "unpin " + P.label[p] })),
        h("div", { class: "compare" }, h("div", { class: "pinned" }, planView(p)), h("div", { class: "current" }, planView(i))));
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

  // ---------- real runs: predicted vs measured step time ----------
  function parityPlot() {
    var el = document.getElementById("parity-plot"), R = D.runs;
    if (!el || !R) return;
    var ok = [];
    for (var k = 0; k < R.trial.length; k++) if (R.measured[k] != null && (R.before[k] != null || R.after[k] != null)) ok.push(k);
    if (!ok.length) return;
    var all = [];
    ok.forEach(function (k) { [R.before[k], R.after[k], R.measured[k], R.high[k]].forEach(function (x) { if (x != null) all.push(x); }); });
    var u = durUnit(all), top = Math.max.apply(null, all) / u[1] * 1.1;
    function trace(name, key, color, symbol) {
      var idx = ok.filter(function (k) { return R[key][k] != null; });
      // counted against every run the page counts (runs_summary): an OOM or failed run has no step to plot
      return { type: "scatter", mode: "markers", name: name + " (" + idx.length + " of " + R.trial.length + " runs)", marker: { color: color, size: 9, symbol: symbol },
        x: idx.map(function (k) { return R.measured[k] / u[1]; }), y: idx.map(function (k) { return R[key][k] / u[1]; }),
        error_x: { type: "data", symmetric: false, array: idx.map(function (k) { return R.high[k] == null ? 0 : (R.high[k] - R.measured[k]) / u[1]; }), arrayminus: idx.map(function (k) { return R.low[k] == null ? 0 : (R.measured[k] - R.low[k]) / u[1]; }), thickness: 1 },
        text: idx.map(function (k) { return "trial " + R.trial[k] + ": " + plotlyText(R.label[k]); }), hovertemplate: "%{text}<br>measured %{x:.3g}, predicted %{y:.3g} " + u[0] + "<extra></extra>" };
    }
    newPlot(el, [
      { type: "scatter", mode: "lines", name: "perfect prediction", x: [0, top], y: [0, top], line: { color: "#999", dash: "dot" }, hoverinfo: "skip" },
      trace("predicted when run", "before", "#2e86c1", "circle"), trace("re-predicted (refitted calibration)", "after", "#c0392b", "diamond")
    ], {
      margin: { l: 70, r: 20, t: 10, b: 50 }, legend: { orientation: "h", y: -0.25 },
      xaxis: { title: { text: "measured step time (" + u[0] + ", 95% interval)" }, range: [0, top] }, yaxis: { title: { text: "predicted step time (" + u[0] + ")" }, range: [0, top] }
    });
    el.setAttribute("data-drawn", "1");
  }

  // ---------- capacity ----------
  function capacityPlot() {
    var el = document.getElementById("capacity-plot"), c = D.capacity;
    if (!el || !c || !c.nodes.length) return;
    var text = c.nodes.map(function (n, k) { return n + " nodes (" + c.gpus[k] + " GPUs): " + plotlyText(c.label[k]); });
    newPlot(el, [
      { type: "scatter", mode: "lines+markers", name: "days to train", x: c.nodes, y: c.days, text: text, hovertemplate: "%{text}<br>%{y:.1f} days<extra></extra>" },
      { type: "scatter", mode: "lines+markers", name: "cost (" + c.currency + ")", x: c.nodes, y: c.cost, yaxis: "y2", text: text, hovertemplate: "%{text}<br>%{y:,.0f} " + c.currency + "<extra></extra>" }
    ], {
      margin: { l: 70, r: 80, t: 10, b: 50 }, legend: { orientation: "h", y: -0.25 },
      xaxis: { title: { text: "nodes" }, type: "log", tickvals: c.nodes },
      // both from zero: a 39% rise in cost must not fill the chart (from the minimum it would look tenfold)
      yaxis: { title: { text: "days to train" }, rangemode: "tozero" },
      yaxis2: { title: { text: "cost (" + c.currency + (c.price != null ? " at " + c.price + " per GPU-hour" : "") + ")" }, overlaying: "y", side: "right", rangemode: "tozero" }
    });
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
        parityPlot(); mark("parity");
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
