// Injected into a page before </body> by tests/conftest.py's ``page_layout`` fixture, then
// read back from Chromium's --dump-dom. It measures the laid-out page at the window's
// width and lists every problem a person would see:
//  - the page scrolls sideways, or a visible element ends past the right edge (cut off);
//  - an element with overflow other than visible hides part of its content (clipped);
//  - two cells of a table row overlap;
//  - in every SVG: a text outside the drawing's viewBox (cut off), two texts overlapping,
//    a text over a circle (a step number must sit inside its own circle), a connecting
//    line (class edge or guide) running through a circle or over a text.
(function () {
  const W = document.documentElement.clientWidth;
  const res = {width: W, scrollWidth: document.documentElement.scrollWidth, problems: [],
               counts: {elements: 0, svgTexts: 0, circles: 0, lines: 0}};
  const P = (m) => { if (res.problems.length < 50) res.problems.push(m); };
  const desc = (el) => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
      (el.className && typeof el.className === 'string' ? '.' + el.className.split(' ').join('.') : '') +
      ' "' + (el.textContent || '').trim().slice(0, 40) + '"';
  const overlap = (a, b, tol) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > tol &&
      Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > tol;
  if (res.scrollWidth > W + 1) P(`the page scrolls sideways: ${res.scrollWidth} > ${W} px`);
  for (const el of document.querySelectorAll('body *')) {
    if (el.closest('svg') && el.tagName.toLowerCase() !== 'svg') continue;
    if (el.closest('details:not([open])') && !el.matches('details, summary') &&
        !el.closest('summary')) continue;
    const r = el.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    res.counts.elements++;
    if (r.right > W + 1) P(`${desc(el)} is cut off at the right edge (${Math.round(r.right)} > ${W})`);
    if (r.left < -1) P(`${desc(el)} starts left of the page`);
    const cs = getComputedStyle(el);
    if (cs.overflowX !== 'visible' && el.scrollWidth > el.clientWidth + 1)
      P(`${desc(el)} clips its content (${el.scrollWidth} > ${el.clientWidth})`);
  }
  for (const tr of document.querySelectorAll('tr')) {
    if (tr.closest('details:not([open])')) continue;
    const cells = [...tr.children].map((c) => c.getBoundingClientRect());
    for (let i = 0; i < cells.length; i++)
      for (let j = i + 1; j < cells.length; j++)
        if (overlap(cells[i], cells[j], 1)) P(`cells ${i} and ${j} of a row overlap: ${desc(tr)}`);
  }
  const segDist = (x1, y1, x2, y2, px, py) => {
    const dx = x2 - x1, dy = y2 - y1, L = dx * dx + dy * dy;
    let t = L ? ((px - x1) * dx + (py - y1) * dy) / L : 0;
    t = Math.max(0, Math.min(1, t));
    return Math.hypot(x1 + t * dx - px, y1 + t * dy - py);
  };
  const segHitsBox = (l, b) => {   // a segment against a box (SVG user units), 0.5 inset
    const x0 = b.x + 0.5, y0 = b.y + 0.5, x1 = b.x + b.width - 0.5, y1 = b.y + b.height - 0.5;
    for (let k = 0; k <= 64; k++) {
      const t = k / 64, x = l.x1 + t * (l.x2 - l.x1), y = l.y1 + t * (l.y2 - l.y1);
      if (x > x0 && x < x1 && y > y0 && y < y1) return true;
    }
    return false;
  };
  for (const svg of document.querySelectorAll('svg')) {
    if (svg.closest('details:not([open])')) continue;
    const sr = svg.getBoundingClientRect();
    if (sr.right > W + 1) P(`an svg is cut off at the right edge (${Math.round(sr.right)} > ${W})`);
    const vb = svg.viewBox.baseVal;
    const box = (b) => ({left: b.x, right: b.x + b.width, top: b.y, bottom: b.y + b.height});
    const texts = [...svg.querySelectorAll('text')].map((t) => ({el: t, b: t.getBBox()}));
    const circles = [...svg.querySelectorAll('circle')].map((c) => ({
      cx: +c.getAttribute('cx'), cy: +c.getAttribute('cy'), r: +c.getAttribute('r')}));
    const lines = [...svg.querySelectorAll('line.edge, line.guide')].map((l) => ({
      x1: +l.getAttribute('x1'), y1: +l.getAttribute('y1'),
      x2: +l.getAttribute('x2'), y2: +l.getAttribute('y2'), cls: l.getAttribute('class')}));
    res.counts.svgTexts += texts.length; res.counts.circles += circles.length;
    res.counts.lines += lines.length;
    for (const t of texts) {
      const b = t.b, name = `svg text "${t.el.textContent.slice(0, 30)}"`;
      if (vb && vb.width && (b.x < vb.x - 0.5 || b.x + b.width > vb.x + vb.width + 0.5 ||
                             b.y < vb.y - 0.5 || b.y + b.height > vb.y + vb.height + 0.5))
        P(`${name} is cut off: outside the drawing`);
      const num = t.el.classList.contains('num');
      for (const c of circles) {
        const inside = Math.hypot(b.x + b.width / 2 - c.cx, b.y + b.height / 2 - c.cy) < c.r;
        if (num) continue;
        const nx = Math.max(b.x, Math.min(c.cx, b.x + b.width));
        const ny = Math.max(b.y, Math.min(c.cy, b.y + b.height));
        if (Math.hypot(nx - c.cx, ny - c.cy) < c.r - 0.5 || inside) P(`${name} overlaps a circle`);
      }
      if (num && !circles.some((c) => Math.hypot(b.x + b.width / 2 - c.cx, b.y + b.height / 2 - c.cy) < c.r / 2))
        P(`${name}: a step number outside its circle`);
      for (const l of lines) if (!num && segHitsBox(l, b)) P(`a ${l.cls} line runs over ${name}`);
    }
    for (let i = 0; i < texts.length; i++)
      for (let j = i + 1; j < texts.length; j++)
        if (overlap(box(texts[i].b), box(texts[j].b), 0.5))
          P(`svg texts "${texts[i].el.textContent.slice(0, 20)}" and "${texts[j].el.textContent.slice(0, 20)}" overlap`);
    for (const l of lines)
      for (const c of circles)
        if (segDist(l.x1, l.y1, l.x2, l.y2, c.cx, c.cy) < c.r - 0.5)
          P(`a ${l.cls} line runs through the circle at (${c.cx}, ${c.cy})`);
  }
  res.height = document.documentElement.scrollHeight;
  const pre = document.createElement('pre');
  pre.id = 'kph-layout'; pre.style.display = 'none';
  pre.textContent = JSON.stringify(res);
  document.body.appendChild(pre);
})();
