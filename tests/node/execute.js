// A raw Jupyter websocket client for Sandgate in Node, with nothing but the `ws` package:
// start a kernel (REST), open /api/kernels/{id}/channels with the token, send an
// execute_request for `1+1` in the legacy JSON format, print what comes back for it
// (status, execute_input, execute_result, execute_reply), then delete the kernel.
//
//   node execute.js URL TOKEN [CODE]        (or SANDGATE_URL / SANDGATE_TOKEN)
//
// Exits 0 when the cell ran (execute_reply status "ok" and the kernel went idle), 1 otherwise.
'use strict';
const crypto = require('crypto');
const WebSocket = require('ws');

const url = (process.argv[2] || process.env.SANDGATE_URL || 'http://127.0.0.1:8888').replace(/\/$/, '');
const token = process.argv[3] || process.env.SANDGATE_TOKEN || '';
const code = process.argv[4] || '1+1';
const auth = token ? { Authorization: `token ${token}` } : {};

async function rest(method, path, body) {
  const r = await fetch(url + path, {
    method, headers: { ...auth, 'Content-Type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await r.text();
  if (!r.ok) throw new Error(`${method} ${path}: ${r.status} ${text}`);
  return text ? JSON.parse(text) : null;
}

function run(kernelId) {
  return new Promise((resolve, reject) => {
    const session = crypto.randomUUID();
    const ws = new WebSocket(`${url.replace(/^http/, 'ws')}/api/kernels/${kernelId}/channels?session_id=${session}`,
                             { headers: auth });
    const msgId = crypto.randomUUID();
    let reply = null, idle = false;
    const timer = setTimeout(() => { ws.terminate(); reject(new Error('no reply within 120 s')); }, 120000);
    ws.on('open', () => {
      ws.send(JSON.stringify({
        channel: 'shell',
        header: { msg_id: msgId, msg_type: 'execute_request', session, username: 'node',
                  version: '5.3', date: new Date().toISOString() },
        parent_header: {}, metadata: {},
        content: { code, silent: false, store_history: true, user_expressions: {}, allow_stdin: false },
      }));
      console.log(`sent execute_request ${JSON.stringify(code)}`);
    });
    ws.on('message', (data) => {
      const m = JSON.parse(data.toString());
      if (m.parent_header.msg_id !== msgId) return;       // not ours (e.g. a starting status)
      const c = m.content;
      switch (m.msg_type) {
        case 'status': console.log(`${m.channel} status: ${c.execution_state}`); idle = c.execution_state === 'idle'; break;
        case 'execute_input': console.log(`${m.channel} execute_input [${c.execution_count}]: ${c.code}`); break;
        case 'stream': console.log(`${m.channel} stream ${c.name}: ${c.text.trimEnd()}`); break;
        case 'execute_result': console.log(`${m.channel} execute_result [${c.execution_count}]: ${c.data['text/plain']}`); break;
        case 'error': console.log(`${m.channel} error: ${c.ename}: ${c.evalue}`); break;
        case 'execute_reply': console.log(`${m.channel} execute_reply: ${c.status}`); reply = c; break;
        default: console.log(`${m.channel} ${m.msg_type}`);
      }
      if (reply && idle) { clearTimeout(timer); ws.close(); resolve(reply); }
    });
    ws.on('unexpected-response', (req, res) => {
      clearTimeout(timer); reject(new Error(`websocket refused: HTTP ${res.statusCode}`));
    });
    ws.on('error', (e) => { clearTimeout(timer); reject(e); });
  });
}

(async () => {
  const kernel = await rest('POST', '/api/kernels', { name: 'python3' });
  console.log(`kernel ${kernel.id} started`);
  let ok = false;
  try {
    ok = (await run(kernel.id)).status === 'ok';
  } finally {
    await rest('DELETE', `/api/kernels/${kernel.id}`);
    console.log(`kernel ${kernel.id} deleted`);
  }
  process.exit(ok ? 0 : 1);
})().catch((e) => { console.error(`error: ${e.message}`); process.exit(1); });
