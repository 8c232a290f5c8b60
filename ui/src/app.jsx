import { useEffect, useState } from 'preact/hooks';
import * as api from './api.js';
import { Overview } from './overview.jsx';
import { RunView } from './run.jsx';

// App holds the session: it asks the server whether the page's cookie is a live session,
// shows the sign-in form when not, and the views once it is.
export function App() {
  const [sess, setSess] = useState({ state: 'checking' });
  const [run, setRun] = useState('');

  useEffect(() => {
    api.onSignedOut(() => {
      api.setCsrf('');
      setSess({ state: 'signin', message: 'The session ended: sign in again.' });
    });
    api.session().then((r) => {
      if (r.ok) {
        api.setCsrf(r.csrf);
        setSess({ state: 'in', auth: r.auth });
      } else {
        setSess({ state: 'signin', message: r.status === 401 ? '' : r.error });
      }
    });
  }, []);

  if (sess.state === 'checking') return <p class="muted">Connecting…</p>;
  if (sess.state === 'signin') {
    return (
      <SignIn
        message={sess.message}
        onSignedIn={(r) => {
          api.setCsrf(r.csrf);
          setSess({ state: 'in', auth: r.auth });
        }}
      />
    );
  }
  const signOut = async () => {
    await api.signOut();
    api.setCsrf('');
    setSess({ state: 'signin', message: 'Signed out.' });
  };
  return (
    <div class="app">
      <header>
        <h1>deltagym</h1>
        {sess.auth ? (
          <button id="sign-out" type="button" onClick={signOut}>
            Sign out
          </button>
        ) : (
          <span class="muted">auth is off</span>
        )}
      </header>
      <div class="columns">
        <Overview run={run} onRun={setRun} />
        <main>{run ? <RunView key={run} run={run} /> : <p class="muted">Pick a run to see its groups and checkpoint tree.</p>}</main>
      </div>
    </div>
  );
}

function SignIn({ message, onSignedIn }) {
  const [token, setToken] = useState('');
  const [error, setError] = useState('');
  const [busy, setBusy] = useState(false);
  const submit = async (ev) => {
    ev.preventDefault();
    setBusy(true);
    setError('');
    const r = await api.signIn(token);
    setBusy(false);
    if (r.ok) {
      setToken('');
      onSignedIn(r);
    } else {
      setError(r.error || `sign-in refused (${r.status})`);
    }
  };
  return (
    <form id="sign-in" class="signin" onSubmit={submit}>
      <h1>deltagym</h1>
      <p>
        Sign in with the server's token (<code>--token</code>, or the file <code>token</code> in its data directory).
      </p>
      {message && <p class="muted">{message}</p>}
      <label>
        Token{' '}
        <input id="token" type="password" autocomplete="current-password" value={token} onInput={(e) => setToken(e.currentTarget.value)} />
      </label>
      <button id="sign-in-button" type="submit" disabled={busy || !token}>
        Sign in
      </button>
      {error && (
        <p id="sign-in-error" class="error" role="alert">
          {error}
        </p>
      )}
    </form>
  );
}
