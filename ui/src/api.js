// The API client of the web view: the server's Connect protocol with JSON bodies
// (POST /deltagym.v1.<Service>/<Method>, Content-Type application/json). A signed-in page
// is authenticated by its session cookie, which the browser sends, and proves with the
// X-CSRF-Token header that the call comes from the page itself.

// ApiError is an error the server answered, with its Connect code.
export class ApiError extends Error {
  constructor(code, message, status) {
    super(message ? `${code}: ${message}` : code);
    this.code = code;
    this.status = status;
  }
}

let csrfToken = '';
let onUnauthenticated = () => {};

// setCsrf keeps the token the session endpoint gave for this session.
export function setCsrf(token) {
  csrfToken = token || '';
}

// onSignedOut sets what happens when the server no longer takes the session.
export function onSignedOut(fn) {
  onUnauthenticated = fn;
}

// call sends one unary call and returns the decoded response message.
export async function call(service, method, message) {
  const headers = { 'Content-Type': 'application/json', 'Connect-Protocol-Version': '1' };
  if (csrfToken) headers['X-CSRF-Token'] = csrfToken;
  let resp;
  try {
    resp = await fetch(`/deltagym.v1.${service}/${method}`, {
      method: 'POST',
      headers,
      body: JSON.stringify(message || {}),
      credentials: 'same-origin',
      cache: 'no-store',
    });
  } catch (err) {
    throw new ApiError('unavailable', `the server did not answer (${err.message})`, 0);
  }
  const text = await resp.text();
  let body = {};
  try {
    body = text ? JSON.parse(text) : {};
  } catch {
    body = { code: 'unknown', message: text.slice(0, 200) };
  }
  if (!resp.ok) {
    const err = new ApiError(body.code || `http ${resp.status}`, body.message || '', resp.status);
    if (err.code === 'unauthenticated') onUnauthenticated(err);
    throw err;
  }
  return body;
}

async function sessionRequest(method, payload) {
  const init = { method, credentials: 'same-origin', cache: 'no-store', headers: {} };
  if (payload !== undefined) {
    init.headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(payload);
  }
  if (csrfToken) init.headers['X-CSRF-Token'] = csrfToken;
  let resp;
  try {
    resp = await fetch('/ui/session', init);
  } catch (err) {
    return { ok: false, error: `the server did not answer (${err.message})` };
  }
  let body = {};
  try {
    body = await resp.json();
  } catch {
    body = { error: `the server answered ${resp.status}` };
  }
  return { ok: resp.ok, status: resp.status, ...body };
}

// session asks whether the page's cookie is a live session (or whether the server needs none).
export const session = () => sessionRequest('GET');

// signIn trades the server's token for a session cookie.
export const signIn = (token) => sessionRequest('POST', { token });

// signOut clears the session cookie.
export const signOut = () => sessionRequest('DELETE');

// listAll fetches every page of ListEpisodes for the request.
export async function listAllEpisodes(req) {
  const out = [];
  let pageToken = '';
  for (;;) {
    const resp = await call('LedgerService', 'ListEpisodes', { ...req, pageSize: 1000, pageToken });
    out.push(...(resp.episodes || []));
    pageToken = resp.nextPageToken || '';
    if (!pageToken) return out;
  }
}
