import { useEffect, useState } from 'preact/hooks';
import { call } from './api.js';
import { stepsUpTo } from './graph.js';
import { ErrorLine, fmt, shortId, statusName } from './util.jsx';

// NodePanel shows a drawn node: the steps that led to it, its diff against its parent and a
// button that forks it into a new sandbox.
export function NodePanel({ node, episodes }) {
  const first = node.members[0];
  const live = node.members.find((m) => !m.released) || first;
  const ep = episodes.find((e) => e.episodeId === first.episodeId);
  return (
    <section id="node-panel" class="panel" data-node-key={node.key}>
      <h3>
        Checkpoint <span class="mono">{node.ids.join(', ')}</span>
      </h3>
      <dl class="facts">
        <dt>kind</dt>
        <dd>{(first.kind || '').replace('CHECKPOINT_KIND_', '').toLowerCase()}</dd>
        <dt>episode</dt>
        <dd class="mono">
          {first.episodeId || '–'} {ep && <span class="muted">({statusName(ep.status)})</span>}
        </dd>
        <dt>after step</dt>
        <dd>{first.stepIndex || 0}</dd>
        <dt>reward</dt>
        <dd>
          {fmt(node.reward)} <span class="muted">over {node.count} episodes</span>
        </dd>
        <dt>started here</dt>
        <dd>{node.started}</dd>
        <dt>parents</dt>
        <dd class="mono">{node.parents.join(', ') || '–'}</dd>
      </dl>
      <Fork checkpointId={live.checkpointId} released={live.released} />
      <Steps episodeId={first.episodeId} stepIndex={first.stepIndex || 0} />
      <Diff base={node.parents[0]} checkpointId={first.checkpointId} />
    </section>
  );
}

function Steps({ episodeId, stepIndex }) {
  const [state, setState] = useState({ steps: null, error: null });
  useEffect(() => {
    if (!episodeId) return undefined;
    let live = true;
    // The steps before a checkpoint never change: one call suffices.
    call('LedgerService', 'GetTrajectory', { episodeId }).then(
      (r) => live && setState({ steps: stepsUpTo(r.steps, stepIndex), error: null }),
      (err) => live && setState({ steps: null, error: err }),
    );
    return () => {
      live = false;
    };
  }, [episodeId, stepIndex]);
  if (!episodeId) return <p class="muted">taken in no episode: no steps</p>;
  return (
    <div class="steps">
      <h4>Steps</h4>
      <ErrorLine error={state.error} />
      {state.steps && !state.steps.length && <p class="muted">no steps before it</p>}
      {state.steps && state.steps.length > 0 && (
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
            {state.steps.map((s) => (
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

function Diff({ base, checkpointId }) {
  const [open, setOpen] = useState(false);
  const [unified, setUnified] = useState(false);
  const [state, setState] = useState({ diff: null, error: null, loading: false });
  useEffect(() => {
    if (!open || !base) return undefined;
    let live = true;
    setState((s) => ({ ...s, loading: true }));
    const detail = unified ? 'DIFF_DETAIL_UNIFIED' : 'DIFF_DETAIL_LINES';
    call('EnvService', 'DiffCheckpoints', { baseCheckpointId: base, checkpointId, detail }).then(
      (diff) => live && setState({ diff, error: null, loading: false }),
      (err) => live && setState({ diff: null, error: err, loading: false }),
    );
    return () => {
      live = false;
    };
  }, [open, unified, base, checkpointId]);
  if (!base) return <p class="muted">a root: no parent to diff against</p>;
  const d = state.diff;
  return (
    <div class="diff">
      <h4>
        <button id="diff-toggle" type="button" onClick={() => setOpen(!open)}>
          {open ? 'Hide' : 'Show'} the diff against <span class="mono">{shortId(base)}</span>
        </button>
      </h4>
      {open && (
        <div id="diff-panel" data-base={base} data-state={state.loading ? 'loading' : state.error ? 'error' : d ? 'done' : 'idle'}>
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

function Fork({ checkpointId, released }) {
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
      <button id="fork" type="button" disabled={state.busy || released} onClick={fork}>
        Fork into a new sandbox
      </button>
      {released && <span class="muted"> released: it can no longer be forked</span>}
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
