// Calls to the Lab server's sandgate routes (sandgate_lab/handlers.py), which hold the
// gateway's URL and token; the browser sends only its Lab session's credentials.
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface ILimits {
  memory_mb: number;
  cpus: number;
  pids: number;
  disk_mb: number;
}

export interface ISandbox {
  id: string;
  state: string;
  pause_mode: string | null;
  execution_state: string;
  driver: string;
  parent: { sandbox: string | null; checkpoint: string | null } | null;
  head: string | null;
  limits: ILimits;
  created: string;
  last_activity: string;
  reason: string | null;
  // Reported by gateways that measure it; the panel shows the limit alone otherwise.
  memory_used_mb?: number | null;
}

export interface ICheckpoint {
  id: string;
  sandbox: string;
  parent: string | null;
  created: number;
  name: string;
  state_bytes: number;
  files_bytes: number;
}

export interface ITree {
  checkpoints: ICheckpoint[];
  forks: { id: string; parent: string; state: string }[];
}

/** An error answer, with the gateway's message, status and code as it gave them. */
export class SandgateError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly code: string = ''
  ) {
    super(message);
  }
}

export function kernelUrl(kid: string, ...parts: string[]): string {
  const settings = ServerConnection.makeSettings();
  return URLExt.join(settings.baseUrl, 'sandgate/api/kernels', kid, ...parts);
}

export function encodePath(path: string): string {
  return path
    .split('/')
    .filter(p => p !== '')
    .map(encodeURIComponent)
    .join('/');
}

export async function request(
  url: string,
  init: RequestInit = {}
): Promise<Response> {
  const settings = ServerConnection.makeSettings();
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (e) {
    throw new SandgateError(`the Lab server did not answer: ${e}`, 0);
  }
  if (!response.ok) {
    let body: any = {};
    try {
      body = await response.json();
    } catch {
      body = { message: response.statusText };
    }
    throw new SandgateError(
      body.message || `${response.status} ${response.statusText}`,
      response.status,
      body.code || ''
    );
  }
  return response;
}

async function json<T>(kid: string, endpoint: string, init: RequestInit = {}): Promise<T> {
  const response = await request(kernelUrl(kid, endpoint), init);
  return (await response.json()) as T;
}

function post(body: object): RequestInit {
  return {
    method: 'POST',
    body: JSON.stringify(body),
    headers: { 'Content-Type': 'application/json' }
  };
}

export const api = {
  sandbox: (kid: string) => json<ISandbox>(kid, ''),
  tree: (kid: string) => json<ITree>(kid, 'tree'),
  checkpoints: (kid: string) => json<ICheckpoint[]>(kid, 'checkpoints'),
  checkpoint: (kid: string, name?: string) =>
    json<ICheckpoint>(kid, 'checkpoints', post(name ? { name } : {})),
  fork: (kid: string, checkpoint?: string) =>
    json<ISandbox>(kid, 'fork', post(checkpoint ? { checkpoint } : {})),
  pause: (kid: string, mode: 'disk' | 'memory') =>
    json<ISandbox>(kid, 'pause', post({ mode })),
  resume: (kid: string) => json<ISandbox>(kid, 'resume', post({}))
};
