// HTTP to this server: the API key (kept in this browser, sent as Authorization: Bearer),
// JSON requests, and the server-sent events of a streamed answer.

const KEY = 'lss.apiKey';

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export const auth = {
  key: localStorage.getItem(KEY) || '',
  // called on every 401: the page shows its API key field
  onUnauthorized: () => {},
};

export function setKey(key) {
  auth.key = key.trim();
  if (auth.key) localStorage.setItem(KEY, auth.key);
  else localStorage.removeItem(KEY);
}

async function errorText(r) {
  try {
    const body = await r.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch {
    return `${r.status} ${r.statusText}`;
  }
}

// The server's paths relative to the page ('/props' -> './props'): behind --api-prefix the
// page is at /prefix/ and so is every route.
export const url = (path) => (path.startsWith('/') ? '.' + path : path);

// fetch with the key; a 401 calls auth.onUnauthorized and throws, any other error status
// throws an ApiError with the server's message.
export async function api(path, opts = {}) {
  const headers = new Headers(opts.headers || {});
  if (auth.key) headers.set('Authorization', 'Bearer ' + auth.key);
  if (opts.body !== undefined) headers.set('Content-Type', 'application/json');
  const r = await fetch(url(path), { ...opts, headers, credentials: 'same-origin' });
  if (r.status === 401) {
    auth.onUnauthorized();
    throw new ApiError(401, await errorText(r));
  }
  if (!r.ok) throw new ApiError(r.status, await errorText(r));
  return r;
}

export async function getJSON(path) {
  return (await api(path)).json();
}

// The JSON objects of an SSE response, in order, until [DONE] or the end of the body.
export async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf('\n\n')) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block
        .split('\n')
        .filter((l) => l.startsWith('data:'))
        .map((l) => l.slice(5).trimStart())
        .join('\n');
      if (!data) continue;
      if (data === '[DONE]') return;
      yield JSON.parse(data);
    }
  }
}
