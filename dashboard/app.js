/* Foreshock dashboard: plain JavaScript over the daemon's JSON API, plots
 * with dygraphs (embedded in the daemon, no network needed).
 *
 * One refresh cycle every REFRESH_MS: runs (+ open alert counts), then the
 * chosen run's detail, series lists, alerts, and the points of every series
 * whose last step moved. Plots are updated in place (no flicker); tables and
 * lists are rebuilt only when their content changed. */
'use strict';

(function () {
  const REFRESH_MS = 5000;
  const MAX_POINTS = 400;      // buckets per series (server-side downsampling)
  const PAGE = 1000;           // items per API page
  const MAX_RUNS = 10000;      // runs listed
  const MAX_OPEN_ALERTS = 5000; // open alerts counted for the run list
  const MAX_ALERTS = 1000;     // rows in a run's alert table
  const MAX_HEAD_LINES = 64;   // per-head lines in one monitor plot

  // Attention monitors: one plot each; the aggregate over heads is bold.
  const QK_MONITORS = [
    { name: 'qk.d2.entropy', title: 'Δ2 spectral entropy', agg: 'min' },
    { name: 'qk.d2.erank', title: 'Δ2 effective rank', agg: 'min' },
    { name: 'qk.d2.srank', title: 'Δ2 stable rank', agg: 'min' },
    { name: 'qk.cqk', title: 'C_QK (Q/K update coupling)', agg: 'max' },
  ];
  // Router monitors: one plot each, one line per MoE layer.
  const ROUTER_MONITORS = [
    { name: 'router.similarity', title: 'router row similarity' },
    { name: 'router.kappa', title: 'router conditioning κ' },
    { name: 'router.entropy_norm', title: 'routing entropy (normalised)' },
    { name: 'router.maxvio', title: 'load imbalance (MaxVio)' },
    { name: 'router.zloss', title: 'router z-loss' },
    { name: 'router.dead_experts', title: 'dead experts' },
  ];
  const SCALARS = [
    { name: 'loss', title: 'loss' },
    { name: 'grad_norm', title: 'gradient norm' },
    { name: 'step_update_ratio', title: 'step size |W(t) − W(t−1)| / |W(t−1)|' },
  ];
  const HEAD_COLORS = ['#4e79a7', '#f28e2b', '#59a14f', '#b07aa1', '#76b7b2', '#edc948',
    '#ff9da7', '#9c755f', '#e15759', '#bab0ac'];

  const $ = (id) => document.getElementById(id);

  const state = {
    token: sessionStorage.getItem('foreshock.token'),
    run: null, layer: null, window: null,
    runsKey: '', alertsKey: '', metaKey: '', selectKey: '',
    runExists: true,
    alerts: [],            // the chosen run's alerts, newest first
    attempts: [],          // the chosen run's attempts (rewinds: resume_step)
    points: new Map(),     // series id -> {stamp, rows: [[step, mean, min, max]]}
    plots: new Map(),      // plot key -> {card, div, markers, graph, filter}
    timer: null, busy: false, again: false, cycles: 0,
  };

  // --- API --------------------------------------------------------------------

  class ApiError extends Error {
    constructor(kind, message, status) { super(message); this.kind = kind; this.status = status; }
  }

  async function api(path) {
    const headers = {};
    if (state.token) headers.Authorization = 'Bearer ' + state.token;
    let resp;
    try {
      resp = await fetch(path, { headers, cache: 'no-store' });
    } catch (e) {
      throw new ApiError('unreachable', 'the daemon is unreachable (' + e.message + ')');
    }
    if (resp.status === 401) throw new ApiError('auth', 'a read token is required', 401);
    let doc = null;
    try { doc = await resp.json(); } catch (e) { /* not JSON: reported below */ }
    if (!resp.ok || doc === null) {
      const msg = doc && doc.error ? doc.error.message : 'HTTP ' + resp.status;
      throw new ApiError(resp.status === 404 ? 'not_found' : 'http', msg, resp.status);
    }
    return doc;
  }

  // Follows keyset pages ("next" -> after=) up to max items.
  async function apiAll(path, key, max) {
    const sep = path.includes('?') ? '&' : '?';
    let items = [], after = null;
    do {
      const doc = await api(path + sep + 'limit=' + Math.min(PAGE, max) +
                            (after ? '&after=' + encodeURIComponent(after) : ''));
      items = items.concat(doc[key]);
      after = doc.next;
    } while (after && items.length < max);
    return items.slice(0, max);
  }

  const q = encodeURIComponent;
  const seriesList = (params) => apiAll('/api/v1/series?run=' + q(state.run) + params,
    'series', 10000);

  // --- small helpers ------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === 'class') e.className = v;
      else if (k.startsWith('data-')) e.setAttribute(k, v);
      else e[k] = v;
    }
    for (const c of children) e.append(c instanceof Node ? c : String(c));
    return e;
  }

  function fmt(v) {
    if (v === null || v === undefined) return '–';
    if (typeof v !== 'number') return String(v);
    if (Number.isInteger(v)) return String(v);
    return Math.abs(v) >= 1e5 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(3)
      : v.toPrecision(4);
  }

  function scope(labels) {
    const parts = [];
    if (labels.layer !== undefined) parts.push('L' + labels.layer);
    if (labels.head !== undefined) parts.push('H' + labels.head);
    if (labels.window !== undefined) parts.push('w' + labels.window);
    if (labels.rank !== undefined) parts.push('r' + labels.rank);
    return parts.join(' ') || 'run';
  }

  function readHash() {
    const h = new URLSearchParams(location.hash.slice(1));
    const num = (k) => (h.has(k) && /^\d+$/.test(h.get(k)) ? Number(h.get(k)) : null);
    return { run: h.get('run'), layer: num('layer'), window: num('window') };
  }

  function writeHash() {
    const h = new URLSearchParams();
    if (state.run !== null) h.set('run', state.run);
    if (state.layer !== null) h.set('layer', state.layer);
    if (state.window !== null) h.set('window', state.window);
    const s = '#' + h.toString();
    if (location.hash !== s) history.replaceState(null, '', s);
  }

  function setStatus(text, isError) {
    $('status').textContent = text;
    $('status').classList.toggle('error', !!isError);
  }

  function showBanner(text) {
    $('banner').hidden = !text;
    $('banner').textContent = text || '';
  }

  // --- run list -------------------------------------------------------------------

  async function refreshRuns() {
    const [runs, open] = await Promise.all([
      apiAll('/api/v1/runs', 'runs', MAX_RUNS),
      apiAll('/api/v1/alerts?state=open', 'alerts', MAX_OPEN_ALERTS),
    ]);
    const counts = new Map();
    for (const a of open) {
      const c = counts.get(a.run) || { firing: 0, pending: 0 };
      if (a.state === 'firing' || a.state === 'pending') c[a.state]++;
      counts.set(a.run, c);
    }
    runs.sort((a, b) => (b.created_at || 0) - (a.created_at || 0) || (a.id < b.id ? 1 : -1));
    const rows = runs.map((r) => ({ id: r.id, step: r.last_step, world: r.world_size,
      local: r.topology ? r.topology.local_ranks : null,
      reports: r.reports, ...(counts.get(r.id) || { firing: 0, pending: 0 }) }));
    state.runExists = state.run === null || runs.some((r) => r.id === state.run);
    const key = JSON.stringify([rows, state.run]);
    if (key === state.runsKey) return;
    state.runsKey = key;
    $('runs-empty').hidden = rows.length > 0;
    $('runs').replaceChildren(...rows.map((r) => el('li',
      { 'data-run': r.id, class: r.id === state.run ? 'selected' : '' },
      el('a', { href: '#run=' + q(r.id) }, r.id),
      el('span', { class: 'meta' },
        r.firing ? el('span', { class: 'badge firing' }, r.firing + ' firing') : '',
        r.pending ? el('span', { class: 'badge pending' }, r.pending + ' pending') : '',
        'step ' + fmt(r.step) + ' · ' + (r.local ? 'ranks ' + r.local + ' of ' : '') +
        fmt(r.world) + ' ranks · ' + fmt(r.reports) + ' reports'))));
  }

  // --- plots --------------------------------------------------------------------------

  // A plot card in container; created once per key, then updated in place.
  function plotCard(container, key, title) {
    let p = state.plots.get(key);
    if (p) return p;
    const div = el('div', { class: 'plot' });
    const markers = el('div', { class: 'markers' });
    const note = el('div', { class: 'note' });
    const card = el('div', { class: 'plot-card', 'data-plot': key },
      el('h3', {}, title), note, el('div', { class: 'plot-wrap' }, div, markers));
    container.append(card);
    p = { card, div, markers, note, graph: null, filter: () => true };
    state.plots.set(key, p);
    return p;
  }

  function dropPlots(prefix) {
    for (const [key, p] of state.plots) {
      if (!key.startsWith(prefix)) continue;
      if (p.graph) p.graph.destroy();
      p.card.remove();
      state.plots.delete(key);
    }
  }

  // Fetches points of the series whose (points, last_step) changed.
  async function loadPoints(series) {
    await Promise.all(series.map(async (s) => {
      const stamp = s.points + ':' + s.last_step;
      const have = state.points.get(s.id);
      if (have && have.stamp === stamp) return;
      const doc = await api('/api/v1/series/' + s.id + '/points?max_points=' + MAX_POINTS);
      state.points.set(s.id, { stamp, rows: doc.points });
    }));
  }

  // Dygraph rows [step, v1, v2, ...] of several series merged on step.
  // On a log scale a value <= 0 has no place (a step that moved no weight
  // sends a step size of 0): it is drawn as a gap (the step stays on the
  // x axis, and with it any marker there), and a band's low end that
  // reaches it is drawn from the bucket's mean.
  const onLog = (v) => (v !== null && v > 0 ? v : null);

  function merge(series, bars, log) {
    const byStep = new Map();
    series.forEach((s, i) => {
      const pts = state.points.get(s.id);
      for (let [step, mean, lo, hi] of pts ? pts.rows : []) {
        if (log) {
          mean = onLog(mean);
          hi = onLog(hi);
          lo = onLog(lo) ?? mean;
          if (mean === null) lo = hi = null;
        }
        let row = byStep.get(step);
        if (!row) {
          row = [step].concat(series.map(() => (bars ? [null, null, null] : null)));
          byStep.set(step, row);
        }
        row[i + 1] = bars ? [lo, mean, hi] : mean;
      }
    });
    return [...byStep.values()].sort((a, b) => a[0] - b[0]);
  }

  // Draws (or updates) one plot. lines: [{series, label, bold}]
  function drawPlot(p, lines, opts) {
    const data = merge(lines.map((l) => l.series), opts.bars, opts.log);
    if (data.length === 0) {
      p.note.textContent = 'no points yet';
      return;
    }
    p.note.textContent = opts.note || '';
    const seriesOpts = {};
    lines.forEach((l, i) => {
      seriesOpts[l.label] = l.bold ? { strokeWidth: 3, color: '#1d232a' }
        : { strokeWidth: 1, color: HEAD_COLORS[i % HEAD_COLORS.length] };
    });
    const options = {
      file: data,
      labels: ['step'].concat(lines.map((l) => l.label)),
      series: seriesOpts,
    };
    if (p.graph) {
      p.graph.updateOptions(options);
      return;
    }
    p.graph = new Dygraph(p.div, data, Object.assign(options, {
      customBars: !!opts.bars,
      logscale: !!opts.log,
      connectSeparatedPoints: true,
      xlabel: 'step',
      legend: 'onmouseover',
      labelsSeparateLines: true,
      labelsKMB: true,
      animatedZooms: false,
      drawCallback: (g) => placeMarkers(p, g),
    }));
  }

  // Vertical markers at each fired alert's step (DOM elements over the
  // canvas, so they carry a tooltip and a link), and a dashed one at each
  // rewind: the step an attempt restarted from (a checkpoint).
  function placeMarkers(p, g) {
    const area = g.getArea();
    const [x0, x1] = g.xAxisRange();
    const marks = [];
    for (const t of state.attempts) {
      const step = t.resume_step;
      if (step === null || step < x0 || step > x1) continue;
      marks.push(el('span', {
        class: 'rewind-marker', 'data-attempt': t.attempt, 'data-step': step,
        title: 'attempt ' + t.attempt + ' restarted from a checkpoint at step ' + step +
          ': the steps after it are its own',
        style: 'left:' + g.toDomXCoord(step) + 'px;top:' + area.y + 'px;height:' +
          area.h + 'px',
      }));
    }
    for (const a of state.alerts) {
      const step = a.evidence.fired_step;
      if (step === null || step < x0 || step > x1 || !p.filter(a)) continue;
      const x = g.toDomXCoord(step);
      marks.push(el('a', {
        class: 'alert-marker sev-' + a.severity + ' state-' + a.state,
        'data-alert-id': a.id, 'data-step': step, href: '/api/v1/alerts/' + a.id,
        title: a.rule + ' (' + a.severity + ', ' + a.attribution + ', ' + scope(a.labels) +
          ') fired at step ' + step,
        style: 'left:' + x + 'px;top:' + area.y + 'px;height:' + area.h + 'px',
      }));
    }
    p.markers.replaceChildren(...marks);
  }

  function redrawMarkers() {
    for (const p of state.plots.values()) if (p.graph) placeMarkers(p, p.graph);
  }

  // Scalars: rank 0 (the lowest rank reporting), min/mean/max per bucket.
  async function refreshScalars() {
    const found = await Promise.all(SCALARS.map((m) => seriesList('&name=' + q(m.name))));
    const chosen = found.map((list) => list.slice().sort((a, b) =>
      (a.labels.rank ?? 0) - (b.labels.rank ?? 0))[0]);
    await loadPoints(chosen.filter(Boolean));
    SCALARS.forEach((m, i) => {
      const p = plotCard($('scalar-plots'), 'scalar:' + m.name, m.title);
      const s = chosen[i];
      if (!s) {
        p.note.textContent = 'not reported by this run';
        return;
      }
      drawPlot(p, [{ series: s, label: m.name }],
        { bars: true, log: true,
          note: 'rank ' + (s.labels.rank ?? 0) + ', log scale, band: min–max per bucket' });
    });
  }

  // Layers and windows that have attention monitors; fills the selectors.
  async function refreshSelectors() {
    const aggs = await seriesList('&name=' + q(QK_MONITORS[1].name + '.min'));
    const layers = [...new Set(aggs.map((s) => s.labels.layer))].sort((a, b) => a - b);
    const windows = [...new Set(aggs.map((s) => s.labels.window))].sort((a, b) => a - b);
    if (!layers.includes(state.layer)) {
      // start where the trouble started: the earliest fired attention alert
      const first = state.alerts
        .filter((a) => a.rule.startsWith('qk.') && a.evidence.fired_step !== null &&
                       layers.includes(a.labels.layer))
        .sort((a, b) => a.evidence.fired_step - b.evidence.fired_step)[0];
      state.layer = first ? first.labels.layer : (layers.length ? layers[0] : null);
      if (first && windows.includes(first.labels.window)) state.window = first.labels.window;
    }
    if (!windows.includes(state.window)) state.window = windows.length ? windows[0] : null;
    const key = JSON.stringify([layers, windows, state.layer, state.window]);
    if (key !== state.selectKey) {
      state.selectKey = key;
      const opts = (vals, cur) => vals.map((v) => el('option', { value: v, selected: v === cur }, v));
      $('layer').replaceChildren(...opts(layers, state.layer));
      $('window').replaceChildren(...opts(windows, state.window));
      $('window-label').hidden = windows.length < 2;
    }
    return layers.length > 0;
  }

  async function refreshQk() {
    const hasQk = await refreshSelectors();
    $('qk-empty').hidden = hasQk;
    if (!hasQk) {
      $('qk-empty').textContent = 'This run has sent no attention sketches yet (scalars ' +
        'only, or the first window is not complete): there are no mechanism monitors to show.';
      dropPlots('qk:');
      return;
    }
    const L = state.layer, W = state.window;
    const labels = '&layer=' + L + '&window=' + W;
    const lists = await Promise.all(QK_MONITORS.map((m) => Promise.all([
      seriesList('&name=' + q(m.name + '.' + m.agg) + labels),
      seriesList('&name=' + q(m.name) + labels),
    ])));
    const all = [];
    for (const [agg, heads] of lists) all.push(...agg, ...heads.slice(0, MAX_HEAD_LINES));
    await loadPoints(all);
    QK_MONITORS.forEach((m, i) => {
      const [agg, heads] = lists[i];
      const key = 'qk:' + m.name + ':' + L + ':' + W;
      const p = plotCard($('qk-plots'), key, m.title + ' · layer ' + L);
      p.filter = (a) => a.labels.layer === undefined || a.labels.layer === L;
      const lines = heads.slice(0, MAX_HEAD_LINES)
        .sort((a, b) => a.labels.head - b.labels.head)
        .map((s) => ({ series: s, label: 'head ' + s.labels.head }));
      if (agg.length) lines.unshift({ series: agg[0], label: m.agg + ' over heads', bold: true });
      if (!lines.length) {
        p.note.textContent = 'no series';
        return;
      }
      drawPlot(p, lines, { note: 'bold: ' + m.agg + ' over heads; window ' + W + ' steps' +
        (heads.length > MAX_HEAD_LINES ? '; first ' + MAX_HEAD_LINES + ' heads' : '') });
    });
  }

  async function refreshRouter() {
    const lists = await Promise.all(ROUTER_MONITORS.map((m) => seriesList('&name=' + q(m.name))));
    const any = lists.some((l) => l.length > 0);
    $('router-section').hidden = !any;
    if (!any) {
      dropPlots('router:');
      return;
    }
    await loadPoints(lists.flat());
    ROUTER_MONITORS.forEach((m, i) => {
      const p = plotCard($('router-plots'), 'router:' + m.name, m.title);
      p.filter = (a) => a.rule.startsWith('router.') || a.labels.layer === undefined;
      const lines = lists[i].slice().sort((a, b) => a.labels.layer - b.labels.layer)
        .map((s) => ({ series: s, label: 'layer ' + s.labels.layer }));
      if (!lines.length) {
        p.note.textContent = 'no series';
        return;
      }
      drawPlot(p, lines, { note: 'one line per MoE layer' });
    });
  }

  // --- alerts -------------------------------------------------------------------------

  async function refreshAlerts() {
    const alerts = await apiAll('/api/v1/alerts?run=' + q(state.run), 'alerts', MAX_ALERTS);
    const key = JSON.stringify(alerts.map((a) => [a.id, a.state, a.updated_at]));
    state.alerts = alerts;
    if (key === state.alertsKey) return;
    state.alertsKey = key;
    $('alerts-empty').hidden = alerts.length > 0;
    $('alerts').hidden = alerts.length === 0;
    $('alerts-count').textContent = alerts.length ? alerts.length + ' (newest first)' : '';
    const num = (cls, v) => el('td', { class: 'num ' + cls }, fmt(v));
    $('alerts').tBodies[0].replaceChildren(...alerts.map((a) => {
      const ev = a.evidence;
      const href = '/api/v1/alerts/' + a.id;
      const tr = el('tr', { 'data-alert-id': a.id,
        class: 'sev-' + a.severity + ' state-' + a.state, title: 'open ' + href },
      el('td', { class: 'id' }, el('a', { href }, a.id)),
      el('td', { class: 'rule' }, a.rule),
      el('td', { class: 'state' }, a.state),
      el('td', { class: 'severity' }, a.severity),
      el('td', { class: 'attribution' }, a.attribution),
      el('td', { class: 'scope' }, scope(a.labels)),
      num('first-breach', ev.first_breach_step), num('fired', ev.fired_step),
      num('resolved', ev.resolved_step), num('value', ev.value), num('median', ev.median),
      num('mad', ev.mad), num('z', ev.z));
      tr.addEventListener('click', (e) => { if (e.target.tagName !== 'A') location.href = href; });
      return tr;
    }));
    redrawMarkers();
  }

  // --- the chosen run ------------------------------------------------------------------

  async function refreshRun() {
    let doc;
    try {
      doc = await api('/api/v1/runs/' + q(state.run));
    } catch (e) {
      if (e.kind !== 'not_found') throw e;
      $('run-view').hidden = true;
      $('run-empty').hidden = false;
      $('run-empty').textContent = 'No run named “' + state.run + '” on this daemon.';
      return;
    }
    const r = doc.run;
    $('run-empty').hidden = true;
    $('run-view').hidden = false;
    $('run-title').textContent = r.id;
    state.attempts = r.attempts || [];
    const rewinds = state.attempts.filter((t) => t.resume_step !== null);
    $('run-attempts').hidden = state.attempts.length < 2;
    const attemptText = (t) => 'attempt ' + t.attempt + (t.resume_step === null
      ? (t.attempt === state.attempts[0].attempt ? ' (start)' : ' (restart, same steps)')
      : ' from step ' + fmt(t.resume_step) + (t.rebuilt_at === null ? ' (rebuilding…)' : ''));
    $('run-attempts').replaceChildren(...state.attempts.map((t) =>
      el('span', { class: 'attempt', 'data-attempt': t.attempt }, attemptText(t))));
    $('run-meta').textContent = (state.attempts.length > 1 ? 'attempt ' +
      state.attempts[state.attempts.length - 1].attempt + ' · ' + rewinds.length +
      ' rewind' + (rewinds.length === 1 ? '' : 's') + ' · ' : '') +
      'last step ' + fmt(r.last_step) + ' · ' + fmt(r.world_size) +
      ' ranks · ' + fmt(r.reports) + ' reports · ' + fmt(r.series) + ' series · ' +
      r.alerts.firing + ' firing, ' + r.alerts.pending + ' pending' +
      (r.incomplete ? ' · ' + r.incomplete + ' incomplete reductions' : '') +
      // A per-node daemon: say which statistics are the node's, not the job's.
      (r.topology ? ' · local group ' + r.topology.local_ranks + ' (' + r.topology.ranks +
        ' of ' + fmt(r.world_size) + ' ranks; router token statistics are this group\'s; ' +
        'loss/grad norm/lr of rank ' + r.topology.lead_rank + ')' : '');
    // alerts first: the plots draw their markers from them
    await refreshAlerts();
    await Promise.all([refreshScalars(), refreshQk(), refreshRouter()]);
  }

  // Switches the view to another run / layer / window (from the hash or a selector).
  function choose(sel) {
    const runChanged = sel.run !== state.run;
    if (runChanged) {
      dropPlots('');
      state.points.clear();
      state.alerts = [];
      state.attempts = [];
      state.alertsKey = '';
      state.selectKey = '';
      state.runsKey = '';
      $('alerts').tBodies[0].replaceChildren();
    } else if (sel.layer !== state.layer || sel.window !== state.window) dropPlots('qk:');
    state.run = sel.run;
    if (runChanged || sel.layer !== null) state.layer = sel.layer;
    if (runChanged || sel.window !== null) state.window = sel.window;
    if (state.run === null) {
      $('run-view').hidden = true;
      $('run-empty').hidden = false;
      $('run-empty').textContent = 'Choose a run.';
    }
    refreshSoon();
  }

  // --- refresh loop ----------------------------------------------------------------------

  async function refresh() {
    if (state.busy) {
      state.again = true;
      return;
    }
    state.busy = true;
    clearTimeout(state.timer);
    try {
      await refreshRuns();
      if (state.run !== null) {
        await refreshRun();
        writeHash();
      }
      showBanner('');
      $('auth').hidden = true;
      state.cycles++;
      document.body.dataset.state = 'ready';
      document.body.dataset.cycles = state.cycles;
      setStatus('updated ' + new Date().toLocaleTimeString() + ' · every ' +
        REFRESH_MS / 1000 + ' s');
    } catch (e) {
      failed(e);
    } finally {
      state.busy = false;
      if (state.again) {
        state.again = false;
        refreshSoon();
      } else if (document.body.dataset.state !== 'auth') {
        state.timer = setTimeout(refresh, REFRESH_MS);
      }
    }
  }

  function refreshSoon() {
    clearTimeout(state.timer);
    state.timer = setTimeout(refresh, 0);
  }

  function failed(e) {
    if (e instanceof ApiError && e.kind === 'auth') {
      document.body.dataset.state = 'auth';
      $('auth').hidden = false;
      $('auth-msg').textContent = state.token ? 'the token was refused' : '';
      setStatus('waiting for a read token', true);
      $('token').focus();
      return;
    }
    document.body.dataset.state = 'error';
    const what = e instanceof ApiError ? e.message : 'page error: ' + e.message;
    // the last data stays on screen; say that it is stale
    showBanner((e.kind === 'unreachable' ? 'Daemon unreachable at ' + location.host + ': '
      : 'Request failed: ') + what + '. Showing the last data; retrying every ' +
      REFRESH_MS / 1000 + ' s.');
    setStatus('error', true);
    if (!(e instanceof ApiError)) console.error(e);
  }

  // --- wiring ----------------------------------------------------------------------------

  $('auth').addEventListener('submit', (ev) => {
    ev.preventDefault();
    state.token = $('token').value.trim();
    sessionStorage.setItem('foreshock.token', state.token);
    $('auth').hidden = true;
    document.body.dataset.state = 'loading';
    refreshSoon();
  });
  $('layer').addEventListener('change', () => {
    choose({ run: state.run, layer: Number($('layer').value), window: state.window });
  });
  $('window').addEventListener('change', () => {
    choose({ run: state.run, layer: state.layer, window: Number($('window').value) });
  });
  window.addEventListener('hashchange', () => {
    const h = readHash();
    if (h.run !== state.run || h.layer !== state.layer || h.window !== state.window) choose(h);
  });

  choose(readHash());
}());
