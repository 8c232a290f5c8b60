import { useMemo, useState } from 'preact/hooks';
import { call, listAllEpisodes } from './api.js';
import { buildGraph, rewardChoices, rewardLabel, totalReward } from './graph.js';
import { NodePanel } from './node.jsx';
import { usePoll } from './poll.js';
import { Tree } from './tree.jsx';
import { ErrorLine, fmt, shortId, statusName } from './util.jsx';

// RunView shows one run: its checkpoint tree, coloured by a choice of reward, with the
// selected node's panel beside it, then its groups with rewards and GRPO advantages. A
// selected node keeps its selection across updates (by checkpoint ID).
export function RunView({ run }) {
  const data = usePoll(async () => {
    const [episodes, tree] = await Promise.all([
      listAllEpisodes({ run }),
      call('LedgerService', 'GetCheckpointTree', { run }),
    ]);
    const groupIds = [...new Set(episodes.map((e) => e.groupId).filter(Boolean))].sort();
    const groups = await Promise.all(
      groupIds.map(async (g) => ({ groupId: g, ...(await call('LedgerService', 'GetGroupAdvantages', { groupId: g })) })),
    );
    return { episodes, nodes: tree.nodes || [], groups };
  }, [run]);
  const [selected, setSelected] = useState('');
  const [by, setBy] = useState(totalReward);
  const episodes = data.data?.episodes || [];
  const choices = useMemo(() => rewardChoices(episodes), [data.data]);
  const graph = useMemo(() => buildGraph(data.data?.nodes || [], episodes, by), [data.data, by]);
  const node = selected ? graph.byCkpt.get(selected) : null;
  const label = rewardLabel(by);
  return (
    <div class="run" data-run={run}>
      <h2>
        Run <span class="mono">{run || '(no run)'}</span>
      </h2>
      <ErrorLine error={data.error} />
      <div class={node ? 'run-body with-panel' : 'run-body'}>
        <section class="tree-section">
          <h3>Checkpoint tree</h3>
          {data.loaded && !graph.drawn.length && <p class="muted">no checkpoints in this run yet</p>}
          {graph.drawn.length > 0 && (
            <Tree
              graph={graph}
              selected={node ? node.key : ''}
              onSelect={(d) => setSelected(d.ids[0])}
              colour={{ by, label, choices, onBy: setBy }}
            />
          )}
        </section>
        {node && <NodePanel key={node.key} node={node} graph={graph} episodes={episodes} label={label} onClose={() => setSelected('')} />}
      </div>
      <Groups groups={data.data?.groups || []} episodes={episodes} />
    </div>
  );
}

function Groups({ groups, episodes }) {
  const byId = new Map(episodes.map((e) => [e.episodeId, e]));
  if (!groups.length) return null;
  return (
    <section id="groups">
      <h3>Groups</h3>
      {groups.map((g) => (
        <details key={g.groupId} class="group" data-group-id={g.groupId} open={groups.length <= 4}>
          <summary>
            <span class="mono">{g.groupId}</span>{' '}
            <span class="muted">
              {g.countedCount || 0} counted · mean {fmt(g.mean || 0)} · std {fmt(g.std || 0)}
            </span>
          </summary>
          <table>
            <thead>
              <tr>
                <th>episode</th>
                <th>status</th>
                <th>reward</th>
                <th>advantage</th>
              </tr>
            </thead>
            <tbody>
              {(g.advantages || []).map((a) => (
                <tr key={a.episodeId} data-episode-id={a.episodeId}>
                  <td class="mono" title={a.episodeId}>
                    {shortId(a.episodeId)}
                  </td>
                  <td>{statusName(byId.get(a.episodeId)?.status)}</td>
                  <td class="num">{a.counted ? fmt(a.reward || 0) : '–'}</td>
                  <td class="num">{a.counted ? fmt(a.advantage || 0) : <span class="muted">{a.reason}</span>}</td>
                </tr>
              ))}
            </tbody>
          </table>
        </details>
      ))}
    </section>
  );
}
