// The checkpoint graph of a run as the page draws it. Checkpoints whose state digests are
// equal (files and processes) are one drawn node; a checkpoint reached from several others
// (parent_ids) has several parents, and the graph may have cycles (a deduplicating checkpoint
// that found an ancestor's state: an undo). It is laid out as a tree along each drawn node's
// first parent drawn before it, which no cycle can break, and its other parent links, a link
// back to an ancestor among them, are drawn apart (dashed).
import { hierarchy, tree } from 'd3-hierarchy';

// parentIdsOf returns every parent of a checkpoint node, parent_id first.
export function parentIdsOf(n) {
  if (n.parentIds && n.parentIds.length) return n.parentIds;
  return n.parentId ? [n.parentId] : [];
}

// digestKey is the identity of a checkpoint's state, or null while its digest is unknown.
export function digestKey(n) {
  const d = n.digest;
  return d && d.files ? `${d.files} ${d.processes || ''}` : null;
}

const finished = new Set(['EPISODE_STATUS_TERMINATED', 'EPISODE_STATUS_TRUNCATED', 'EPISODE_STATUS_FAILED']);

// ended says whether an episode's total_reward is final and counts towards node rewards, as
// group advantages count it: it terminated, was truncated or failed, and not on a failure of
// the server's. A branched episode (ended by a Restore) has no reward of its own.
export function ended(e) {
  return finished.has(e.status) && e.failureClass !== 'FAILURE_CLASS_INFRA';
}

// totalReward is the colour-by choice of every episode's total_reward.
export const totalReward = '';

// rewardKey names a reported reward (ReportedReward's source and name) as a colour-by choice.
export function rewardKey(source, name) {
  return JSON.stringify([source || '', name || '']);
}

// rewardLabel names a colour-by choice for a person: "name (source)".
export function rewardLabel(key) {
  if (!key) return 'total reward';
  const [source, name] = JSON.parse(key);
  return `${name} (${source})`;
}

// rewardChoices lists the reported rewards found in the episodes, by source then name: the
// choices of what to colour by beside total_reward.
export function rewardChoices(episodes) {
  const seen = new Map();
  for (const e of episodes) {
    for (const r of e.rewards || []) {
      const key = rewardKey(r.source, r.name);
      if (!seen.has(key)) seen.set(key, { key, source: r.source || '', name: r.name || '' });
    }
  }
  return [...seen.values()].sort((a, b) => a.source.localeCompare(b.source) || a.name.localeCompare(b.name));
}

// valueOf returns what an episode counts for under a colour-by choice, or null when it counts
// for nothing. Under total_reward an episode counts once ended. A reported reward counts
// whatever the episode's state, for it is reported when known (a search scores states of
// episodes that are still running); its latest report counts, as a report replaces an
// earlier one of its name and source. An episode that failed on the server's fault counts
// for neither.
export function valueOf(e, by) {
  if (!by) return ended(e) ? e.totalReward || 0 : null;
  if (e.failureClass === 'FAILURE_CLASS_INFRA') return null;
  let v = null;
  for (const r of e.rewards || []) {
    if (rewardKey(r.source, r.name) === by) v = r.value || 0;
  }
  return v;
}

// buildGraph turns GetCheckpointTree's nodes (parents before children) and the run's
// episodes into drawn nodes. A drawn node's reward is the mean value (valueOf, under the
// colour-by choice by) of the episodes that took one of its checkpoints or started from one,
// and of those of every drawn node below it; null when none counts. Its size counts the
// episodes that started from one of its checkpoints (Episode.start_checkpoint_id).
export function buildGraph(nodes, episodes, by = totalReward) {
  const byCkpt = new Map();
  const byDigest = new Map();
  const drawn = [];
  for (const n of nodes) {
    const key = digestKey(n);
    let d = key ? byDigest.get(key) : undefined;
    if (!d) {
      d = { key: n.checkpointId, index: drawn.length, ids: [], members: [], parents: [], started: 0,
        children: [], extra: [], primary: null, sum: 0, count: 0 };
      drawn.push(d);
      if (key) byDigest.set(key, d);
    }
    d.ids.push(n.checkpointId);
    d.members.push(n);
    byCkpt.set(n.checkpointId, d);
  }
  for (const d of drawn) {
    const seen = new Set(d.ids);
    for (const n of d.members) {
      for (const p of parentIdsOf(n)) {
        if (!seen.has(p)) {
          seen.add(p);
          d.parents.push(p);
        }
      }
    }
    const linked = new Set();
    for (const p of d.parents) {
      const pd = byCkpt.get(p);
      if (!pd || linked.has(pd)) continue;
      linked.add(pd);
      if (!d.primary && pd.index < d.index) {
        d.primary = pd;
        pd.children.push(d);
      } else {
        d.extra.push(pd);
      }
    }
  }
  const takenIn = new Map();
  for (const d of drawn) {
    for (const n of d.members) {
      if (!n.episodeId) continue;
      if (!takenIn.has(n.episodeId)) takenIn.set(n.episodeId, new Set());
      takenIn.get(n.episodeId).add(d);
    }
  }
  for (const e of episodes) {
    const start = byCkpt.get(e.startCheckpointId);
    if (start) start.started++;
    const reward = valueOf(e, by);
    if (reward === null) continue;
    const stack = [...(takenIn.get(e.episodeId) || [])];
    if (start) stack.push(start);
    const seen = new Set();
    while (stack.length) {
      const d = stack.pop();
      if (seen.has(d)) continue;
      seen.add(d);
      d.sum += reward;
      d.count++;
      for (const p of d.parents) {
        const pd = byCkpt.get(p);
        if (pd) stack.push(pd);
      }
    }
  }
  let min = Infinity;
  let max = -Infinity;
  for (const d of drawn) {
    d.reward = d.count ? d.sum / d.count : null;
    if (d.reward !== null) {
      min = Math.min(min, d.reward);
      max = Math.max(max, d.reward);
    }
  }
  return { drawn, byCkpt, min: min === Infinity ? null : min, max: max === -Infinity ? null : max };
}

// heldId returns a checkpoint of a drawn node that the server still holds (any: they share
// one state), or null when every one was released.
export function heldId(d) {
  const m = d.members.find((n) => !n.released);
  return m ? m.checkpointId : null;
}

// diffBase finds what a drawn node is diffed against: a held checkpoint of its nearest
// ancestor that has one, searched breadth-first through every parent link, first parents
// first. It returns { id, node, levels } (levels 1: a parent) or null when no ancestor is
// held. A parent the graph lacks is passed over: nothing says it is held.
export function diffBase(graph, d) {
  const seen = new Set([d]);
  let level = [d];
  for (let levels = 1; level.length; levels++) {
    const next = [];
    for (const cur of level) {
      for (const p of cur.parents) {
        const pd = graph.byCkpt.get(p);
        if (!pd || seen.has(pd)) continue;
        seen.add(pd);
        const id = heldId(pd);
        if (id) return { id, node: pd, levels };
        next.push(pd);
      }
    }
    level = next;
  }
  return null;
}

// radius is a drawn node's radius: its area grows with the episodes started from it.
export function radius(d) {
  return Math.min(6 + 3 * Math.sqrt(d.started), 22);
}

const depthStep = 90;

// layout places the drawn nodes (x along depth, y across) and returns the edges to draw, the
// first root's place and the box that holds them all.
export function layout(graph) {
  const roots = graph.drawn.filter((d) => !d.primary);
  const maxR = graph.drawn.reduce((m, d) => Math.max(m, radius(d)), 6);
  const root = hierarchy({ virtual: true, children: roots }, (d) => d.children);
  tree().nodeSize([2 * maxR + 10, depthStep]).separation((a, b) => (a.parent === b.parent ? 1 : 1.25))(root);
  const pos = new Map();
  let minY = Infinity;
  let maxY = -Infinity;
  let maxX = 0;
  root.each((h) => {
    if (h.data.virtual) return;
    const p = { x: (h.depth - 1) * depthStep, y: h.x };
    pos.set(h.data, p);
    minY = Math.min(minY, p.y);
    maxY = Math.max(maxY, p.y);
    maxX = Math.max(maxX, p.x);
  });
  const edges = [];
  for (const d of graph.drawn) {
    if (d.primary) edges.push({ key: `${d.primary.key}>${d.key}`, from: pos.get(d.primary), to: pos.get(d), extra: false });
    for (const pd of d.extra) edges.push({ key: `${pd.key}>${d.key}`, from: pos.get(pd), to: pos.get(d), extra: true });
  }
  const pad = maxR + 12;
  if (!pos.size) {
    minY = 0;
    maxY = 0;
  }
  const first = roots.length ? pos.get(roots[0]) : { x: 0, y: 0 };
  return { pos, edges, root: first, box: { x: -pad, y: minY - pad, width: maxX + 2 * pad, height: maxY - minY + 2 * pad } };
}

// stepsUpTo returns the steps of a trajectory up to a checkpoint taken after the episode's
// stepIndex-th own step: every inherited step, then its first stepIndex own steps.
export function stepsUpTo(steps, stepIndex) {
  const out = [];
  let own = 0;
  for (const s of steps || []) {
    if (s.inherited) {
      out.push(s);
    } else if (own < stepIndex) {
      out.push(s);
      own++;
    }
  }
  return out;
}
