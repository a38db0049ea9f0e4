"""The browser side of every figure (share page and explorer alike): draw, export, drill down.

- `flDraw(root)` draws every `figure.fl-fig` not drawn yet with the local plotly.js and one
  config (CONFIG_JS): no Plotly logo link, no "Share chart" cloud upload (plotly.js 3 shows it by
  default), no Chart Studio edit link; PNG and SVG download buttons.
- Colour bars and clip paths: with a `<base href>` in the page (Gradio has one) plotly.js writes
  every gradient fill as `url('<page URL at draw time>#id')`; the explorer then rewrites the
  address bar (history.replaceState: ?tab=..., ?r=...), the baked URL names another document and
  the fill no longer resolves (a colour bar drawn white). `_baseUrl: ''` makes plotly.js write
  `url(#id)`, a same-document reference whatever the address becomes (CSS Values 4: fragment-only
  URLs are same-document; Chromium and Firefox resolve them so even under a <base>).
- A click on a layer x module heatmap cell (`figure[data-drill]`) or on a row of a per-tensor
  table (`.fl-table[data-tensors] tr`) fetches /api/results/<token>/tensor/view and inserts the
  tensor view under that figure or table; links inside it open the other tensors of the cell.
- "Download figures": every drawn figure of the result as SVG, in one zip built here (stored,
  not deflated: SVG is text and the archive is small), named after the result.
"""

CONFIG_JS = """
function flConfig(name) {
  const P = window.Plotly;
  return {responsive: true, displaylogo: false, showSendToCloud: false, showEditInChartStudio: false,
          showLink: false, _baseUrl: '',
          modeBarButtonsToRemove: ['sendChartToCloud', 'editInChartStudio'],
          toImageButtonOptions: {format: 'png', filename: name, scale: 2},
          modeBarButtonsToAdd: [{name: 'downloadSvg', title: 'Download plot as SVG',
            icon: P.Icons.disk, click: function (gd) { P.downloadImage(gd, {format: 'svg', filename: name}); }}]};
}
"""

DRAW_FN = CONFIG_JS + """
function flToken(node) {
  const r = node.closest && node.closest('[data-token]');
  return r ? r.getAttribute('data-token') : '';
}
function flOpenTensor(anchor, token, params) {
  let slot = anchor.nextElementSibling;
  if (!slot || !slot.classList.contains('fl-tensor-slot')) {
    slot = document.createElement('div');
    slot.className = 'fl-tensor-slot';
    anchor.after(slot);
  }
  slot.setAttribute('data-loading', '1');
  slot.innerHTML = "<p class='fl-meta'>Opening the tensor...</p>";
  const q = new URLSearchParams(params).toString();
  fetch('/api/results/' + encodeURIComponent(token) + '/tensor/view?' + q, {credentials: 'same-origin'})
    .then(function (r) { return r.json().then(function (j) { return [r.ok, j]; }); })
    .then(function (res) {
      slot.removeAttribute('data-loading');
      if (!res[0]) { slot.innerHTML = "<p class='fl-banner fl-warn' role='alert'></p>";
                     slot.firstChild.textContent = 'Cannot open this tensor: ' + (res[1].detail || 'error'); return; }
      slot.innerHTML = res[1].html;
      flDraw(slot);
      slot.scrollIntoView({block: 'nearest'});
    })
    .catch(function (e) { slot.removeAttribute('data-loading'); slot.textContent = 'Cannot open this tensor: ' + e; });
}
function flBind(root) {
  if (root.__flBound) { return; }
  root.__flBound = true;
  root.addEventListener('click', function (e) {
    const t = e.target;
    const link = t.closest && t.closest('a.fl-open-tensor');
    if (link) {
      e.preventDefault();
      const sec = link.closest('.fl-tensor-slot');
      flOpenTensor(sec.previousElementSibling, flToken(sec), {name: link.getAttribute('data-name')});
      return;
    }
    if (t.closest && t.closest('.fl-tensor-close')) { const s = t.closest('.fl-tensor-slot'); if (s) { s.remove(); } return; }
    if (t.closest && t.closest('.fl-download-figs')) { e.preventDefault(); flDownloadAll(t.closest('[data-download]')); return; }
    const row = t.closest && t.closest('.fl-table[data-tensors] tbody tr');
    if (row) {
      const name = row.firstElementChild ? row.firstElementChild.innerText.trim() : '';
      if (name) { flOpenTensor(row.closest('.fl-table'), flToken(row), {name: name}); }
    }
  });
}
function flDraw(root) {
  flBind(root);
  const todo = root.querySelectorAll('figure.fl-fig:not([data-drawn])');
  if (!todo.length) { return; }
  if (!window.Plotly) { setTimeout(function () { flDraw(root); }, 30); return; }
  todo.forEach(function (f) {
    const data = f.querySelector('script.fl-fig-data');
    const el = f.querySelector('.fl-plot');
    if (!data || !el) { return; }
    f.setAttribute('data-drawn', '1');
    const fig = JSON.parse(data.textContent);
    const name = (f.getAttribute('data-name') || f.id || 'figure');
    window.Plotly.newPlot(el, fig.data || [], fig.layout || {}, flConfig(name));
    if (f.hasAttribute('data-drill') && flToken(f)) {  // a result's own figures (not Compare's maps)
      el.on('plotly_click', function (ev) {
        const p = ev && ev.points && ev.points[0];
        if (!p || p.data.type !== 'heatmap' || p.z === null || p.z === undefined) { return; }
        flOpenTensor(f, flToken(f), {layer: String(p.y), module: String(p.x)});
      });
    }
  });
}
function flCrc(bytes) {
  let c, crc = 0xFFFFFFFF;
  for (let n = 0; n < bytes.length; n++) {
    c = (crc ^ bytes[n]) & 0xFF;
    for (let k = 0; k < 8; k++) { c = c & 1 ? (c >>> 1) ^ 0xEDB88320 : c >>> 1; }
    crc = (crc >>> 8) ^ c;
  }
  return (crc ^ 0xFFFFFFFF) >>> 0;
}
function flZip(files) {
  const enc = new TextEncoder(), parts = [], central = [];
  let offset = 0;
  function u16(v) { return [v & 255, (v >>> 8) & 255]; }
  function u32(v) { return [v & 255, (v >>> 8) & 255, (v >>> 16) & 255, (v >>> 24) & 255]; }
  files.forEach(function (f) {
    const name = enc.encode(f.name), data = enc.encode(f.text), crc = flCrc(data);
    const head = [].concat(u32(0x04034b50), u16(20), u16(0), u16(0), u16(0), u16(0), u32(crc),
                           u32(data.length), u32(data.length), u16(name.length), u16(0));
    parts.push(new Uint8Array(head), name, data);
    central.push([].concat(u32(0x02014b50), u16(20), u16(20), u16(0), u16(0), u16(0), u16(0), u32(crc),
                           u32(data.length), u32(data.length), u16(name.length), u16(0), u16(0), u16(0),
                           u16(0), u32(0), u32(offset)), name);
    offset += head.length + name.length + data.length;
  });
  let size = 0;
  const cparts = [];
  for (let i = 0; i < central.length; i += 2) { cparts.push(new Uint8Array(central[i]), central[i + 1]);
                                                 size += central[i].length + central[i + 1].length; }
  const end = [].concat(u32(0x06054b50), u16(0), u16(0), u16(files.length), u16(files.length), u32(size),
                        u32(offset), u16(0));
  return new Blob([].concat(parts, cparts, [new Uint8Array(end)]), {type: 'application/zip'});
}
function flDownloadAll(root) {
  if (!root || !window.Plotly) { return; }
  const figs = [...root.querySelectorAll('figure.fl-fig[data-drawn] .js-plotly-plot')];
  const name = root.getAttribute('data-download') || 'figures';
  Promise.all(figs.map(function (gd, i) {
    const f = gd.closest('figure');
    return window.Plotly.toImage(gd, {format: 'svg'}).then(function (url) {
      const text = decodeURIComponent(url.slice(url.indexOf(',') + 1));
      return {name: String(i + 1).padStart(2, '0') + '-' + (f.getAttribute('data-name') || f.id) + '.svg', text: text};
    });
  })).then(function (files) {
    const a = document.createElement('a');
    a.href = URL.createObjectURL(flZip(files));
    a.download = name + '-figures.zip';
    document.body.appendChild(a); a.click(); a.remove();
  });
}
"""
