import { useRef } from 'preact/hooks';
import { call } from './api.js';
import { usePoll } from './poll.js';
import { ErrorLine, shortId, timeOf } from './util.jsx';

// Overview shows the live pools, the leased sandboxes and the runs of the ledger.
export function Overview({ run, onRun }) {
  const envs = usePoll(() => call('EnvService', 'ListEnvs', {}), []);
  const boxes = usePoll(() => call('EnvService', 'ListSandboxes', {}), []);
  const runs = useRuns();
  return (
    <nav>
      <section id="pools">
        <h2>Pools</h2>
        <ErrorLine error={envs.error} />
        <table>
          <thead>
            <tr>
              <th>env</th>
              <th title="warm sandboxes ready for Reset">warm</th>
              <th title="sandboxes leased to clients">active</th>
            </tr>
          </thead>
          <tbody>
            {(envs.data?.envs || []).map((e) => (
              <tr key={e.spec?.name} data-env={e.spec?.name}>
                <td>
                  {e.spec?.name}
                  {(e.notReady || e.waitingForCapacity) && <div class="error small">{e.notReady || e.waitingForCapacity}</div>}
                </td>
                <td class="num">{e.warmCount || 0}</td>
                <td class="num">{e.activeCount || 0}</td>
              </tr>
            ))}
          </tbody>
        </table>
      </section>
      <section id="sandboxes">
        <h2>Sandboxes</h2>
        <ErrorLine error={boxes.error} />
        <table>
          <thead>
            <tr>
              <th>sandbox</th>
              <th>env</th>
              <th>run</th>
              <th>steps</th>
            </tr>
          </thead>
          <tbody>
            {(boxes.data?.sandboxes || []).map((s) => (
              <tr key={s.sandboxId} data-sandbox-id={s.sandboxId} title={`episode ${s.episodeId || '-'}, ${s.state || ''}`}>
                <td class="mono">{shortId(s.sandboxId)}</td>
                <td>{s.env}</td>
                <td>{s.run}</td>
                <td class="num">{s.nextStepIndex || 0}</td>
              </tr>
            ))}
          </tbody>
        </table>
        {boxes.loaded && !(boxes.data?.sandboxes || []).length && <p class="muted">none leased</p>}
      </section>
      <section id="runs">
        <h2>Runs</h2>
        <ErrorLine error={runs.error} />
        <ul class="runs">
          {(runs.data || []).map((r) => (
            <li key={r.run}>
              <button type="button" class={r.run === run ? 'run selected' : 'run'} data-run={r.run} onClick={() => onRun(r.run)}>
                <span>{r.run || '(no run)'}</span>
                <span class="muted small">
                  {r.episodes} ep · {timeOf(r.last)}
                </span>
              </button>
            </li>
          ))}
        </ul>
        {runs.loaded && !(runs.data || []).length && <p class="muted">no episodes recorded</p>}
      </section>
    </nav>
  );
}

// useRuns reads the ledger's episodes once, then only from the last page on at each poll
// (ListEpisodes pages in start order), and groups them by run, latest first.
function useRuns() {
  const seen = useRef({ cursor: '', episodes: new Map() });
  return usePoll(async () => {
    const st = seen.current;
    for (;;) {
      const resp = await call('LedgerService', 'ListEpisodes', { pageSize: 1000, pageToken: st.cursor });
      for (const e of resp.episodes || []) st.episodes.set(e.episodeId, e);
      if (!resp.nextPageToken) break;
      st.cursor = resp.nextPageToken;
    }
    const runs = new Map();
    for (const e of st.episodes.values()) {
      const r = runs.get(e.run) || { run: e.run, episodes: 0, last: '' };
      r.episodes++;
      if ((e.startTime || '') > r.last) r.last = e.startTime;
      runs.set(e.run, r);
    }
    return [...runs.values()].sort((a, b) => (a.last < b.last ? 1 : a.last > b.last ? -1 : 0));
  }, []);
}
