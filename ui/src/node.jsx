import { useEffect, useState } from 'preact/hooks';
import { call } from './api.js';
import { diffBase, heldId, stepsUpTo } from './graph.js';
import { ErrorLine, fmt, shortId, statusName } from './util.jsx';

// NodePanel shows a drawn node: the steps that led to its first checkpoint, its diff against
// its nearest held ancestor and a button that forks it into a new sandbox. Diff and fork use
// a checkpoint of the node that the server still holds (heldId): the node's checkpoints share
// one state, and the first may be released while another is held.
export function NodePanel({ node, graph, episodes, label, onClose }) {
  const first = node.members[0];
  const held = heldId(node);
  const ep = episodes.find((e) => e.episodeId === first.episodeId);
  const own = first.stepIndex || 0;
  const traj = useTrajectory(first.episodeId, own);
  return (
    <section id="node-panel" class="panel" data-node-key={node.key} data-held-id={held || ''}>
      <h3>
        Checkpoint <span class="mono">{node.ids.join(', ')}</span>{' '}
        <button class="close" type="button" title="close" onClick={onClose}>
          ×
        </button>
      </h3>
      <dl class="facts">
        <dt>kind</dt>
        <dd>{(first.kind || '').replace('CHECKPOINT_KIND_', '').toLowerCase()}</dd>
        <dt>held</dt>
        <dd class="mono">
          {held ? (
            <>
              {held}
              {node.ids.length > 1 && <span class="muted"> ({node.members.filter((m) => m.released).length} of {node.ids.length} released)</span>}
            </>
          ) : (
            <span class="muted">none: every checkpoint of this node was released</span>
          )}
        </dd>
        <dt>episode</dt>
        <dd class="mono">
          {first.episodeId || '–'} {ep && <span class="muted">({statusName(ep.status)})</span>}
        </dd>
        <dt>taken after</dt>
        <dd id="taken-after">{takenAfter(own, traj.steps)}</dd>
        <dt>{label}</dt>
        <dd>
          {fmt(node.reward)} <span class="muted">mean over {node.count} episodes</span>
        </dd>
        <dt>started here</dt>
        <dd>{node.started}</dd>
        <dt>parents</dt>
        <dd class="mono">{node.parents.join(', ') || '–'}</dd>
      </dl>
      <Fork checkpointId={held} />
      <Steps episodeId={first.episodeId} traj={traj} />
      <Diff node={node} graph={graph} checkpointId={held} />
    </section>
  );
}

// useTrajectory loads the steps up to a checkpoint taken after its episode's own-th own
// step. They never change: one call suffices.
function useTrajectory(episodeId, own) {
  const [state, setState] = useState({ steps: null, error: null });
  useEffect(() => {
    if (!episodeId) return undefined;
    let live = true;
    call('LedgerService', 'GetTrajectory', { episodeId }).then(
      (r) => live && setState({ steps: stepsUpTo(r.steps, own), error: null }),
      (err) => live && setState({ steps: null, error: err }),
    );
    return () => {
      live = false;
    };
  }, [episodeId, own]);
  return state;
}

// range renders step numbers from a to b, as the steps table numbers them.
function range(a, b) {
  return a === b ? `#${a}` : `#${a}–${b}`;
}

// takenAfter says where on its trajectory a checkpoint was taken. CheckpointNode.step_index
// counts its episode's own steps; the trajectory lists the steps inherited from the episodes
// it descends from first, and numbers them all from 0 (TrajectoryStep.step_index).
export function takenAfter(own, steps) {
  const ownText = `${own} own step${own === 1 ? '' : 's'} of its episode`;
  if (!steps) return `${ownText} (and any it inherited)`;
  const inherited = steps.filter((s) => s.inherited).length;
  if (!inherited && !own) return 'before any step';
  if (!inherited) return `${ownText} (${range(0, own - 1)})`;
  const inh = `${inherited} inherited step${inherited === 1 ? '' : 's'} (${range(0, inherited - 1)})`;
  if (!own) return `${inh}, before any of its episode's own`;
  return `${inherited + own} steps: ${inh}, then ${ownText} (${range(inherited, inherited + own - 1)})`;
}

function Steps({ episodeId, traj }) {
  if (!episodeId) return <p class="muted">taken in no episode: no steps</p>;
  return (
    <div class="steps">
      <h4>Steps</h4>
      <ErrorLine error={traj.error} />
      {traj.steps && !traj.steps.length && <p class="muted">no steps before it</p>}
      {traj.steps && traj.steps.length > 0 && (
        <table id="steps">
          <thead>
            <tr>
              <th>#</th>
              <th>action</th>
              <th>result</th>
              <th>reward</th>
            </tr>
          </thead>
          <tbody>
            {traj.steps.map((s) => (
              <tr
                key={s.stepIndex || 0}
                class={s.inherited ? 'inherited' : ''}
                data-step-index={s.stepIndex || 0}
                data-episode-id={s.episodeId}
                title={s.inherited ? `inherited from ${s.episodeId}` : ''}
              >
                <td class="num">{s.stepIndex || 0}</td>
                <td class="mono">{actionText(s.action)}</td>
                <td class="mono">{resultText(s.observation)}</td>
                <td class="num">{fmt(s.reward || 0)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </div>
  );
}

// actionText is a one-line account of an action.
function actionText(a) {
  if (!a) return '–';
  const [kind, v] = Object.entries(a)[0] || ['?', {}];
  switch (kind) {
    case 'exec':
      return `exec ${v.command || (v.argv || []).join(' ')}`;
    case 'writeFile':
    case 'readFile':
    case 'listDir':
    case 'stat':
    case 'remove':
    case 'makeDir':
    case 'upload':
    case 'download':
      return `${kind} ${v.path || ''}`;
    default:
      return kind;
  }
}

// resultText is a one-line account of an observation.
function resultText(o) {
  if (!o) return '–';
  if (o.error) return `error ${o.error.errnoName || ''} ${o.error.message || ''}`;
  if (o.exec) return `exit ${o.exec.exitCode || 0}${o.exec.timedOut ? ' (timed out)' : ''}`;
  if (o.submit) return `reward ${fmt(o.submit.reward || 0)}`;
  const kind = Object.keys(o)[0];
  return kind ? `${kind} ok` : 'ok';
}

const changeNames = { CHANGE_KIND_ADDED: 'added', CHANGE_KIND_REMOVED: 'removed', CHANGE_KIND_MODIFIED: 'modified' };

// releasedHelp says why a diff needs held checkpoints and how a search keeps them.
const releasedHelp =
  'A diff needs both checkpoints held by the server, and a released checkpoint is gone. A search keeps only the ' +
  'checkpoints it keeps: pass the cells or checkpoints to keep to GoExplore.close(keep=...), or release them ' +
  'yourself later, once looked at.';

// Diff shows the diff of a held checkpoint of the node against the nearest ancestor that has
// one held (diffBase), saying which when it is not the parent. Without both it calls
// nothing and says why.
function Diff({ node, graph, checkpointId }) {
  const base = checkpointId ? diffBase(graph, node) : null;
  const baseId = base ? base.id : '';
  const [open, setOpen] = useState(false);
  const [unified, setUnified] = useState(false);
  const [state, setState] = useState({ diff: null, error: null, loading: false });
  useEffect(() => {
    if (!open || !checkpointId || !baseId) return undefined;
    let live = true;
    setState((s) => ({ ...s, loading: true }));
    const detail = unified ? 'DIFF_DETAIL_UNIFIED' : 'DIFF_DETAIL_LINES';
    call('EnvService', 'DiffCheckpoints', { baseCheckpointId: baseId, checkpointId, detail }).then(
      (diff) => live && setState({ diff, error: null, loading: false }),
      (err) => live && setState({ diff: null, error: err, loading: false }),
    );
    return () => {
      live = false;
    };
  }, [open, unified, baseId, checkpointId]);
  if (!node.parents.length) return <p class="muted">a root: no parent to diff against</p>;
  if (!checkpointId || !base) {
    return (
      <p id="diff-unavailable" class="muted">
        {!checkpointId
          ? 'No diff: every checkpoint of this node was released. '
          : 'No diff: no ancestor of this node has a checkpoint still held. '}
        {releasedHelp}
      </p>
    );
  }
  const where = base.levels > 1 ? `${base.levels} levels up` : base.node === graph.byCkpt.get(node.parents[0]) ? 'its parent' : 'another of its parents';
  const d = state.diff;
  return (
    <div class="diff">
      <h4>
        <button id="diff-toggle" type="button" onClick={() => setOpen(!open)}>
          {open ? 'Hide' : 'Show'} the diff of <span class="mono">{shortId(checkpointId)}</span> against{' '}
          <span class="mono">{shortId(base.id)}</span>, {where}
        </button>
      </h4>
      {base.levels > 1 && (
        <p id="diff-note" class="small muted">
          No checkpoint of the nodes between is held: the diff spans {base.levels} levels of the tree.
        </p>
      )}
      {open && (
        <div
          id="diff-panel"
          data-base={base.id}
          data-checkpoint={checkpointId}
          data-levels={base.levels}
          data-state={state.loading ? 'loading' : state.error ? 'error' : d ? 'done' : 'idle'}
        >
          <ErrorLine error={state.error} id="diff-error" />
          {d && (
            <>
              <table id="diff-paths">
                <thead>
                  <tr>
                    <th>change</th>
                    <th>path</th>
                    <th>lines</th>
                  </tr>
                </thead>
                <tbody>
                  {(d.paths || []).map((p) => (
                    <tr key={p.path} data-path={p.path}>
                      <td>{changeNames[p.kind] || p.kind}</td>
                      <td class="mono">{p.path}</td>
                      <td class="num">
                        {p.binary ? 'binary' : p.metadataOnly ? 'metadata' : `+${p.linesAdded || 0} −${p.linesRemoved || 0}`}
                      </td>
                    </tr>
                  ))}
                </tbody>
              </table>
              {!(d.paths || []).length && <p class="muted">no file differs</p>}
              {d.truncated && <p class="muted">more paths differ than were listed</p>}
              {(d.processes || []).length > 0 && (
                <ul class="processes">
                  {d.processes.map((p) => (
                    <li key={`${p.kind}${p.pid}`}>
                      {changeNames[p.kind] || p.kind} pid {p.pid} <span class="mono">{p.command}</span> {(p.details || []).join(', ')}
                    </li>
                  ))}
                </ul>
              )}
              {!unified && (
                <button id="diff-unified" type="button" onClick={() => setUnified(true)}>
                  Show the unified diff
                </button>
              )}
              {unified &&
                (d.paths || [])
                  .filter((p) => p.unifiedDiff)
                  .map((p) => (
                    <pre key={p.path} class="unified" data-path={p.path}>
                      {p.unifiedDiff}
                    </pre>
                  ))}
            </>
          )}
        </div>
      )}
    </div>
  );
}

// Fork forks a held checkpoint of the node into a new sandbox; with none held it cannot.
function Fork({ checkpointId }) {
  const [state, setState] = useState({ busy: false, result: null, error: null });
  const fork = async () => {
    setState({ busy: true, result: null, error: null });
    try {
      const r = await call('EnvService', 'Fork', { checkpointId, n: 1 });
      setState({ busy: false, result: r, error: null });
    } catch (err) {
      setState({ busy: false, result: null, error: err });
    }
  };
  return (
    <div class="fork">
      <button id="fork" type="button" disabled={state.busy || !checkpointId} onClick={fork}>
        Fork {checkpointId ? <span class="mono">{shortId(checkpointId)}</span> : ''} into a new sandbox
      </button>
      {!checkpointId && (
        <span id="fork-unavailable" class="muted">
          {' '}
          every checkpoint of this node was released: none can be forked
        </span>
      )}
      {state.result && (
        <p id="fork-result" data-sandbox-id={(state.result.sandboxIds || [])[0]}>
          New sandbox <span class="mono">{(state.result.sandboxIds || [])[0]}</span>, episode{' '}
          <span class="mono">{(state.result.episodeIds || [])[0]}</span>
        </p>
      )}
      <ErrorLine error={state.error} id="fork-error" />
    </div>
  );
}
