import { interpolateRdYlGn } from 'd3-scale-chromatic';
import { useEffect, useMemo, useRef, useState } from 'preact/hooks';
import { layout, radius } from './graph.js';
import { fmt } from './util.jsx';

const noReward = '#9aa0a6';

// colourOf maps a drawn node's reward onto red (the run's lowest) to green (its highest).
function colourOf(graph, reward) {
  if (reward === null) return noReward;
  const span = graph.max - graph.min;
  return interpolateRdYlGn(span > 0 ? (reward - graph.min) / span : 0.5);
}

function link(from, to) {
  const mx = (from.x + to.x) / 2;
  return `M${from.x},${from.y}C${mx},${from.y} ${mx},${to.y} ${to.x},${to.y}`;
}

// minScale is the smallest scale the tree opens at: below it labels cannot be read, and the
// tree opens with its root in view instead of whole.
const minScale = 0.4;
const scaleLimits = [0.05, 4];

// fitView is the view the tree opens at in a box of size: all of it, centred, when it fits at
// minScale or more; else as much of its depth as fits (at minScale at least), its root at the
// left edge and halfway down. A view maps a layout point p to k·p + (x, y) in the box.
function fitView(lay, size) {
  const { box, root } = lay;
  const whole = Math.min(1, size.w / box.width, size.h / box.height);
  if (whole >= minScale) {
    return { k: whole, x: (size.w - whole * box.width) / 2 - whole * box.x, y: (size.h - whole * box.height) / 2 - whole * box.y };
  }
  const k = Math.max(minScale, Math.min(1, size.w / box.width));
  return { k, x: -k * box.x, y: size.h / 2 - k * root.y };
}

// zoomAt scales a view by factor about the box point (cx, cy), which stays where it is.
function zoomAt(v, factor, cx, cy) {
  const k = Math.min(scaleLimits[1], Math.max(scaleLimits[0], v.k * factor));
  const f = k / v.k;
  return { k, x: cx - f * (cx - v.x), y: cy - f * (cy - v.y) };
}

// panWithin moves a view by (dx, dy) as a scroll box would: only while the tree reaches past
// the box's edge on that side. It returns null when the view cannot move, so that the wheel
// scrolls the page instead.
function panWithin(v, lay, size, dx, dy) {
  const { box } = lay;
  const clamp = (pos, d, lo, extent, room) => {
    if (extent <= room) return pos;
    const min = room - lo - extent;
    const max = -lo;
    return Math.min(max, Math.max(min, pos + d));
  };
  const x = clamp(v.x, dx, v.k * box.x, v.k * box.width, size.w);
  const y = clamp(v.y, dy, v.k * box.y, v.k * box.height, size.h);
  if (Math.abs(x - v.x) < 0.5 && Math.abs(y - v.y) < 0.5) return null;
  return { ...v, x, y };
}

// Tree draws the checkpoint graph: one circle per drawn node (its checkpoint IDs and its
// parents' in data attributes), its first parent's link solid, the others dashed. The box
// takes the window's height; a drag pans it, the wheel scrolls it, ctrl+wheel (a pinch) and
// the buttons zoom, and it opens with the root in view (fitView), which it keeps to until
// moved.
export function Tree({ graph, selected, onSelect, colour }) {
  const lay = useMemo(() => layout(graph), [graph]);
  const boxRef = useRef(null);
  const drag = useRef(null);
  const [size, setSize] = useState({ w: 0, h: 0 });
  const [view, setView] = useState(null);
  // moved is set once the view was panned or zoomed: until then it follows the fit as the
  // box resizes (a node's panel opens beside it) and the tree grows.
  const moved = useRef(false);
  const move = (v) => {
    moved.current = true;
    setView(v);
  };

  useEffect(() => {
    const el = boxRef.current;
    const measure = () => setSize({ w: el.clientWidth, h: el.clientHeight });
    measure();
    const ro = new ResizeObserver(measure);
    ro.observe(el);
    return () => ro.disconnect();
  }, []);
  useEffect(() => {
    if (!moved.current && size.w > 0 && size.h > 0) setView(fitView(lay, size));
  }, [size, lay]);

  const onPointerDown = (e) => {
    if (e.button !== 0 || !view) return;
    drag.current = { id: e.pointerId, sx: e.clientX, sy: e.clientY, v: view, moved: false };
  };
  const onPointerMove = (e) => {
    const g = drag.current;
    if (!g || g.id !== e.pointerId) return;
    const dx = e.clientX - g.sx;
    const dy = e.clientY - g.sy;
    // A press that barely moves is a click on a node: it takes no capture, which would take
    // the click from the node.
    if (!g.moved && Math.hypot(dx, dy) < 4) return;
    if (!g.moved) {
      g.moved = true;
      e.currentTarget.setPointerCapture(g.id);
    }
    move({ ...g.v, x: g.v.x + dx, y: g.v.y + dy });
  };
  const onPointerUp = () => {
    drag.current = null;
  };
  const onWheel = (e) => {
    if (!view) return;
    const r = e.currentTarget.getBoundingClientRect();
    const unit = e.deltaMode === 1 ? 16 : e.deltaMode === 2 ? size.h : 1;
    if (e.ctrlKey || e.metaKey) {
      e.preventDefault();
      move(zoomAt(view, Math.exp(-e.deltaY * unit * 0.002), e.clientX - r.left, e.clientY - r.top));
      return;
    }
    const next = panWithin(view, lay, size, -e.deltaX * unit, -e.deltaY * unit);
    if (next) {
      e.preventDefault();
      move(next);
    }
  };
  const zoomBy = (factor) => view && move(zoomAt(view, factor, size.w / 2, size.h / 2));
  const fit = () => {
    moved.current = false;
    setView(fitView(lay, size));
  };

  return (
    <div class="tree">
      <Legend graph={graph} colour={colour} />
      <div
        class="tree-box"
        ref={boxRef}
        onPointerDown={onPointerDown}
        onPointerMove={onPointerMove}
        onPointerUp={onPointerUp}
        onPointerCancel={onPointerUp}
        onWheel={onWheel}
      >
        <svg id="checkpoint-tree" width="100%" height="100%" data-scale={view ? view.k.toFixed(3) : ''}>
          {view && (
            <g transform={`translate(${view.x},${view.y}) scale(${view.k})`}>
              <g class="edges">
                {lay.edges.map((e) => (
                  <path key={e.key} class={e.extra ? 'edge extra' : 'edge'} d={link(e.from, e.to)} />
                ))}
              </g>
              <g class="nodes">
                {graph.drawn.map((d) => {
                  const p = lay.pos.get(d);
                  const kind = (d.members[0].kind || '').replace('CHECKPOINT_KIND_', '').toLowerCase();
                  const released = d.members.every((m) => m.released);
                  const own = d.members[0].stepIndex || 0;
                  return (
                    <g
                      key={d.key}
                      class={`node${d.key === selected ? ' selected' : ''}${released ? ' released' : ''}${d.primary ? '' : ' root'}`}
                      transform={`translate(${p.x},${p.y})`}
                      data-node-key={d.key}
                      data-checkpoint-ids={d.ids.join(' ')}
                      data-parent-ids={d.parents.join(' ')}
                      data-started={d.started}
                      data-reward={d.reward === null ? '' : d.reward}
                      onClick={() => onSelect(d)}
                    >
                      <title>
                        {`${d.ids.join('\n')}\n${kind}, after ${own} own steps of its episode${released ? ', released' : ''}\n` +
                          `${colour.label} ${fmt(d.reward)} over ${d.count} episodes\n${d.started} episodes started here`}
                      </title>
                      <circle r={radius(d)} fill={colourOf(graph, d.reward)} />
                      <text class="label" x={radius(d) + 3} y={-radius(d) + 1}>
                        {kind === 'user' ? `s${own}` : kind}
                        {d.ids.length > 1 ? ` ×${d.ids.length}` : ''}
                      </text>
                    </g>
                  );
                })}
              </g>
            </g>
          )}
        </svg>
        <div class="tree-controls">
          <button id="zoom-in" type="button" title="zoom in" onClick={() => zoomBy(1.25)}>
            +
          </button>
          <button id="zoom-out" type="button" title="zoom out" onClick={() => zoomBy(0.8)}>
            −
          </button>
          <button id="zoom-fit" type="button" title="the view it opened at" onClick={fit}>
            fit
          </button>
        </div>
      </div>
    </div>
  );
}

const stops = [0, 0.25, 0.5, 0.75, 1];

// Legend says what the colours mean: the colour-by choice (colour: { by, label, choices,
// onBy }), its range over the run, and the sizes.
function Legend({ graph, colour }) {
  const known = colour.choices.some((c) => c.key === colour.by);
  return (
    <div class="legend" id="tree-legend">
      <label>
        Colour by{' '}
        <select id="colour-by" value={colour.by} onChange={(e) => colour.onBy(e.currentTarget.value)}>
          <option value="">total reward</option>
          {colour.choices.map((c) => (
            <option key={c.key} value={c.key}>
              {c.name} ({c.source})
            </option>
          ))}
          {colour.by && !known && <option value={colour.by}>{colour.label}</option>}
        </select>
      </label>
      <span id="legend-range" data-source={colour.label} data-min={graph.min ?? ''} data-max={graph.max ?? ''}>
        <svg width="120" height="12" viewBox="0 0 120 12" aria-hidden="true">
          <defs>
            <linearGradient id="reward-gradient">
              {stops.map((t) => (
                <stop key={t} offset={t} stop-color={interpolateRdYlGn(t)} />
              ))}
            </linearGradient>
          </defs>
          <rect x="0" y="0" width="120" height="12" fill="url(#reward-gradient)" />
        </svg>{' '}
        {graph.min === null ? `no ${colour.label} yet` : `${colour.label}: ${fmt(graph.min)} to ${fmt(graph.max)}`}
      </span>
      <span class="legend-key">
        <svg width="14" height="14" viewBox="0 0 14 14" aria-hidden="true">
          <circle cx="7" cy="7" r="6" fill={noReward} />
        </svg>{' '}
        none counted
      </span>
      <span class="legend-key">
        <svg width="36" height="18" viewBox="0 0 36 18" aria-hidden="true">
          <circle cx="5" cy="9" r="3" fill="none" class="legend-ring" />
          <circle cx="24" cy="9" r="8" fill="none" class="legend-ring" />
        </svg>{' '}
        episodes started
      </span>
      <details class="small muted">
        <summary>reading the tree</summary>
        Colour: the mean {colour.label} of the episodes that took the checkpoint or started from it, and of those below it
        {colour.by ? ' (each episode it was reported for, running or ended)' : ' (ended episodes only)'}. Size: the episodes
        that started from it. Checkpoints of one state digest are one node (×n: how many); dashed links are further parents;
        a dashed ring: every checkpoint of the node was released. Labels: how many of its episode's own steps a checkpoint was
        taken after (s1, s2…), or its kind. Drag to pan, wheel to scroll, ctrl+wheel or the buttons to zoom.
      </details>
    </div>
  );
}
