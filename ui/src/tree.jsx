import { interpolateRdYlGn } from 'd3-scale-chromatic';
import { useMemo } from 'preact/hooks';
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

// Tree draws the checkpoint graph: one circle per drawn node (its checkpoint IDs and its
// parents' in data attributes), its first parent's link solid, the others dashed.
export function Tree({ graph, selected, onSelect }) {
  const lay = useMemo(() => layout(graph), [graph]);
  const { box } = lay;
  return (
    <div class="tree">
      <Legend graph={graph} />
      <div class="tree-scroll">
        <svg id="checkpoint-tree" width={box.width} height={box.height} viewBox={`${box.x} ${box.y} ${box.width} ${box.height}`}>
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
              return (
                <g
                  key={d.key}
                  class={`node${d.key === selected ? ' selected' : ''}${released ? ' released' : ''}`}
                  transform={`translate(${p.x},${p.y})`}
                  data-node-key={d.key}
                  data-checkpoint-ids={d.ids.join(' ')}
                  data-parent-ids={d.parents.join(' ')}
                  data-started={d.started}
                  data-reward={d.reward === null ? '' : d.reward}
                  onClick={() => onSelect(d)}
                >
                  <title>
                    {`${d.ids.join('\n')}\n${kind}, step ${d.members[0].stepIndex || 0}\nreward ${fmt(d.reward)} over ${d.count} episodes\n${d.started} episodes started here`}
                  </title>
                  <circle r={radius(d)} fill={colourOf(graph, d.reward)} />
                  <text class="label" x={radius(d) + 3} y={-radius(d) + 1}>
                    {kind === 'user' ? `s${d.members[0].stepIndex || 0}` : kind}
                    {d.ids.length > 1 ? ` ×${d.ids.length}` : ''}
                  </text>
                </g>
              );
            })}
          </g>
        </svg>
      </div>
    </div>
  );
}

const stops = [0, 0.25, 0.5, 0.75, 1];

function Legend({ graph }) {
  return (
    <div class="legend" id="tree-legend">
      <svg width="330" height="44" viewBox="0 0 330 44">
        <defs>
          <linearGradient id="reward-gradient">
            {stops.map((t) => (
              <stop key={t} offset={t} stop-color={interpolateRdYlGn(t)} />
            ))}
          </linearGradient>
        </defs>
        <rect x="0" y="4" width="160" height="12" fill="url(#reward-gradient)" />
        <text x="0" y="30" class="legend-label">
          {graph.min === null ? 'no reward yet' : fmt(graph.min)}
        </text>
        <text x="160" y="30" class="legend-label" text-anchor="end">
          {graph.max === null ? '' : fmt(graph.max)}
        </text>
        <circle cx="180" cy="10" r="6" fill={noReward} />
        <text x="190" y="14" class="legend-label">
          no ended episode
        </text>
        <circle cx="186" cy="32" r="3" fill="none" class="legend-ring" />
        <circle cx="202" cy="32" r="8" fill="none" class="legend-ring" />
        <text x="214" y="36" class="legend-label">
          episodes started
        </text>
      </svg>
      <p class="small muted">
        Colour: the mean total reward of the ended episodes that took the checkpoint or started from it, and of those below it.
        Size: the episodes that started from it. Checkpoints of one state digest are one node (×n: how many); dashed links are
        further parents. Labels: the step a checkpoint was taken after (s1, s2…), or its kind.
      </p>
    </div>
  );
}
