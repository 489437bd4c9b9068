// A kernel's /workspace as a drive of Lab's contents manager, through the Lab server's
// files proxy (sandgate_lab/handlers.py), which streams to and from the gateway's sandbox
// files API. Paths in Lab are "<drive name>:<path in the workspace>".
import { PathExt } from '@jupyterlab/coreutils';
import { Contents, ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import { encodePath, kernelUrl, request, SandgateError } from './api';

interface IEntry {
  name: string;
  type: 'file' | 'directory' | 'symlink';
  size: number;
  mtime: number;
}

function iso(mtime: number): string {
  return new Date(mtime * 1000).toISOString();
}

function mimetypeOf(name: string): string {
  const ext = PathExt.extname(name).toLowerCase();
  const known: { [ext: string]: string } = {
    '.txt': 'text/plain', '.md': 'text/markdown', '.py': 'text/x-python', '.json': 'application/json',
    '.csv': 'text/csv', '.png': 'image/png', '.jpg': 'image/jpeg', '.jpeg': 'image/jpeg',
    '.svg': 'image/svg+xml', '.ipynb': 'application/x-ipynb+json', '.html': 'text/html'
  };
  return known[ext] || 'application/octet-stream';
}

function kindOf(name: string): Contents.ContentType {
  return PathExt.extname(name).toLowerCase() === '.ipynb' ? 'notebook' : 'file';
}

function toBase64(bytes: Uint8Array): string {
  let s = '';
  for (let i = 0; i < bytes.length; i += 0x8000) {
    s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(s);
}

function fromBase64(b64: string): Uint8Array {
  const s = atob(b64);
  const bytes = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) {
    bytes[i] = s.charCodeAt(i);
  }
  return bytes;
}

export class SandboxDrive implements Contents.IDrive {
  constructor(readonly kernelId: string) {
    this.name = `kernel-${kernelId.slice(0, 8)}`;
    this.serverSettings = ServerConnection.makeSettings();
  }

  readonly name: string;
  readonly serverSettings: ServerConnection.ISettings;

  get fileChanged(): ISignal<this, Contents.IChangedArgs> {
    return this._fileChanged;
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  dispose(): void {
    this._isDisposed = true;
    Signal.clearData(this);
  }

  private _url(path: string, query = ''): string {
    return kernelUrl(this.kernelId, 'files', encodePath(path)) + query;
  }

  async get(path: string, options: Contents.IFetchOptions = {}): Promise<Contents.IModel> {
    path = encodePath(path).split('/').map(decodeURIComponent).join('/');
    if (options.content === false && path !== '') {
      // Lab asks this before each save to see whether the file changed on disk: the
      // listing's mtime answers without reading the file.
      const e = await this._stat(path);
      if (!e) {
        throw new SandgateError(`${path}: no such file in the workspace`, 404, 'not_found');
      }
      return this._model(path, e.type, e.size, e.mtime);
    }
    const known = this._listings.get(path);
    let response: Response;
    try {
      // A directory listed before may be a file browser's poll: the Lab server answers 409
      // "paused" instead of resuming a paused sandbox for it, and the last listing stands.
      response = await request(this._url(path, known ? '?unless_paused=1' : ''));
    } catch (e) {
      if (known && e instanceof SandgateError && e.code === 'paused') {
        return known;
      }
      throw e;
    }
    if (response.headers.get('X-Sandgate-Kind') === 'directory') {
      const listing = (await response.json()) as { entries: IEntry[] };
      const entries = listing.entries.filter(e => e.type !== 'symlink');
      const content = entries.map(e => this._model(PathExt.join(path, e.name), e.type, e.size, e.mtime));
      const model = this._model(path, 'directory', 0, Date.now() / 1000);
      const dir = { ...model, format: 'json' as Contents.FileFormat, content };
      this._listings.set(path, dir);
      return options.content === false ? { ...dir, content: null } : dir;
    }
    const bytes = new Uint8Array(await response.arrayBuffer());
    const e = await this._stat(path);
    const model = this._model(path, 'file', bytes.length, e ? e.mtime : Date.now() / 1000);
    const type = options.type || kindOf(path);
    if (type === 'notebook') {
      const text = new TextDecoder('utf-8').decode(bytes);
      return { ...model, type: 'notebook', format: 'json', content: JSON.parse(text), mimetype: '' };
    }
    if (options.format !== 'base64') {
      try {
        const text = new TextDecoder('utf-8', { fatal: true }).decode(bytes);
        return { ...model, type: 'file', format: 'text', content: text, mimetype: model.mimetype.startsWith('image/') ? 'text/plain' : model.mimetype };
      } catch (e) {
        if (options.format === 'text') {
          throw new SandgateError(`${path} is not UTF-8 text`, 400);
        }
      }
    }
    return { ...model, type: 'file', format: 'base64', content: toBase64(bytes) };
  }

  /** The entry of the parent directory's listing for path; null when it is not there. */
  private async _stat(path: string): Promise<IEntry | null> {
    const response = await request(this._url(PathExt.dirname(path)));
    if (response.headers.get('X-Sandgate-Kind') !== 'directory') {
      return null;
    }
    const listing = (await response.json()) as { entries: IEntry[] };
    return listing.entries.find(e => e.name === PathExt.basename(path)) || null;
  }

  private _model(path: string, type: string, size: number, mtime: number): Contents.IModel {
    const name = PathExt.basename(path);
    return {
      name, path, type: type === 'directory' ? 'directory' : kindOf(name), writable: true,
      created: iso(mtime), last_modified: iso(mtime), mimetype: type === 'directory' ? '' : mimetypeOf(name),
      content: null, format: null, size
    };
  }

  async getDownloadUrl(path: string): Promise<string> {
    return this._url(path, '?download=1');
  }

  async save(
    path: string,
    options: Partial<Contents.IModel> & Contents.IContentProvisionOptions = {}
  ): Promise<Contents.IModel> {
    if (options.type === 'directory') {
      throw new SandgateError('the sandbox files API has no folders of their own: a folder appears with its first file', 400);
    }
    let body: BodyInit;
    if (options.type === 'notebook') {
      body = JSON.stringify(options.content, null, 1);
    } else if (options.format === 'base64') {
      body = fromBase64(options.content || '');
    } else {
      body = options.content ?? '';
    }
    // Lab uploads a large file in chunks (1, 2, ..., -1 for the last); the Lab server
    // appends them to one spool file and sends it to the sandbox with the last.
    const chunk = (options as any).chunk as number | undefined;
    const query = chunk === undefined ? '' : `?chunk=${chunk}`;
    await request(this._url(path, query), {
      method: 'PUT', body, headers: { 'Content-Type': 'application/octet-stream' }
    });
    if (chunk !== undefined && chunk !== -1) {
      // Not in the sandbox until the last chunk.
      return this._model(path, 'file', 0, Date.now() / 1000);
    }
    const model = await this.get(path, { content: false });
    this._fileChanged.emit({ type: 'save', oldValue: null, newValue: model });
    return model;
  }

  async newUntitled(options: Contents.ICreateOptions = {}): Promise<Contents.IModel> {
    const dir = options.path || '';
    if (options.type === 'directory') {
      throw new SandgateError('the sandbox files API has no folders of their own: a folder appears with its first file', 400);
    }
    const notebook = options.type === 'notebook';
    const ext = notebook ? '.ipynb' : options.ext || '.txt';
    const base = notebook ? 'Untitled' : 'untitled';
    const listing = await this.get(dir, { content: true });
    const taken = new Set((listing.content as Contents.IModel[]).map(m => m.name));
    let name = `${base}${ext}`;
    for (let i = 1; taken.has(name); i++) {
      name = `${base}${i}${ext}`;
    }
    const path = PathExt.join(dir, name);
    const content = notebook
      ? { cells: [], metadata: {}, nbformat: 4, nbformat_minor: 5 }
      : '';
    const model = await this.save(path, { type: notebook ? 'notebook' : 'file', format: notebook ? 'json' : 'text', content });
    this._fileChanged.emit({ type: 'new', oldValue: null, newValue: model });
    return model;
  }

  async delete(path: string): Promise<void> {
    await request(this._url(path), { method: 'DELETE' });
    this._fileChanged.emit({ type: 'delete', oldValue: { path }, newValue: null });
  }

  // The files API has no rename or copy: the bytes go through the browser once. Fine for the
  // files one renames by hand; a large file is better renamed in a cell.
  async rename(oldPath: string, newPath: string): Promise<Contents.IModel> {
    await this._copyBytes(oldPath, newPath);
    await request(this._url(oldPath), { method: 'DELETE' });
    const model = await this.get(newPath, { content: false });
    this._fileChanged.emit({ type: 'rename', oldValue: { path: oldPath }, newValue: model });
    return model;
  }

  async copy(path: string, toDir: string): Promise<Contents.IModel> {
    const ext = PathExt.extname(path);
    const stem = PathExt.basename(path, ext);
    const listing = await this.get(toDir, { content: true });
    const taken = new Set((listing.content as Contents.IModel[]).map(m => m.name));
    let name = `${stem}-Copy1${ext}`;
    for (let i = 2; taken.has(name); i++) {
      name = `${stem}-Copy${i}${ext}`;
    }
    const target = PathExt.join(toDir, name);
    await this._copyBytes(path, target);
    const model = await this.get(target, { content: false });
    this._fileChanged.emit({ type: 'new', oldValue: null, newValue: model });
    return model;
  }

  private async _copyBytes(from: string, to: string): Promise<void> {
    const blob = await (await request(this._url(from))).blob();
    await request(this._url(to), { method: 'PUT', body: blob, headers: { 'Content-Type': 'application/octet-stream' } });
  }

  // Lab's file checkpoints (save points of a document) do not exist in a workspace; the
  // sandbox's own checkpoints, memory and files together, are in the Sandbox panel.
  async createCheckpoint(path: string): Promise<Contents.ICheckpointModel> {
    return { id: 'none', last_modified: new Date().toISOString() };
  }

  async listCheckpoints(path: string): Promise<Contents.ICheckpointModel[]> {
    return [];
  }

  async restoreCheckpoint(path: string, id: string): Promise<void> {
    throw new SandgateError('workspace files have no save points; use the Sandbox panel\'s checkpoints', 400);
  }

  async deleteCheckpoint(path: string, id: string): Promise<void> {
    return;
  }

  private _listings = new Map<string, Contents.IModel>();
  private _isDisposed = false;
  private _fileChanged = new Signal<this, Contents.IChangedArgs>(this);
}
