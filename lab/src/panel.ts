// The Sandbox panel: the current notebook's kernel as a Sandgate sandbox (state, driver,
// memory, age, checkpoints and their forks), refreshed while it is shown, with its actions.
// Each action is one entry of ACTIONS (a button) or CHECKPOINT_ACTIONS (a button on each
// checkpoint) naming a command, so the palette and the panel run the same code.
import { CommandRegistry } from '@lumino/commands';
import { Widget } from '@lumino/widgets';

import { api, ICheckpoint, ISandbox, ITree, SandgateError } from './api';

export const CommandIDs = {
  checkpoint: 'sandgate:checkpoint',
  fork: 'sandgate:fork',
  pauseDisk: 'sandgate:pause-disk',
  pauseMemory: 'sandgate:pause-memory',
  resume: 'sandgate:resume',
  showPanel: 'sandgate:show-panel',
  showWorkspace: 'sandgate:show-workspace'
};

interface IAction {
  command: string;
  label: string;
  args?: object;
  // Whether it makes sense for the sandbox as it is now.
  enabled: (sb: ISandbox) => boolean;
}

const RUNNING = (sb: ISandbox) => sb.state === 'running';
const AT_REST = (sb: ISandbox) => sb.state === 'paused' || sb.state === 'frozen';

const ACTIONS: IAction[] = [
  { command: CommandIDs.fork, label: 'Fork from now', enabled: sb => RUNNING(sb) || AT_REST(sb) },
  { command: CommandIDs.pauseDisk, label: 'Pause to disk', args: { mode: 'disk' }, enabled: RUNNING },
  { command: CommandIDs.pauseMemory, label: 'Pause in memory', args: { mode: 'memory' }, enabled: RUNNING },
  { command: CommandIDs.resume, label: 'Resume', enabled: AT_REST }
];

const CHECKPOINT_ACTIONS: IAction[] = [
  { command: CommandIDs.fork, label: 'Fork', enabled: sb => sb.state !== 'dead' }
];

// How often the panel asks while it is shown, in ms.
const REFRESH = 2000;

function age(iso: string): string {
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) {
    return `${Math.round(s)} s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min`;
  }
  if (s < 86400) {
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  }
  return `${Math.floor(s / 86400)} d`;
}

function mib(bytes: number): string {
  return `${(bytes / (1 << 20)).toFixed(1)} MiB`;
}

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K, cls = '', text = '', attrs: { [k: string]: string } = {}
): HTMLElementTagNameMap[K] {
  const e = document.createElement(tag);
  if (cls) {
    e.className = cls;
  }
  if (text) {
    e.textContent = text;
  }
  for (const [k, v] of Object.entries(attrs)) {
    e.setAttribute(k, v);
  }
  return e;
}

export class SandboxPanel extends Widget {
  constructor(private commands: CommandRegistry) {
    super();
    this.id = 'sandgate-sandbox-panel';
    this.addClass('sg-Panel');
    this.title.caption = 'Sandbox (Sandgate)';
    this._timer = window.setInterval(() => {
      if (this.isVisible) {
        void this.refresh();
      }
    }, REFRESH);
    this._render();
  }

  dispose(): void {
    window.clearInterval(this._timer);
    super.dispose();
  }

  /** The notebook and kernel to show (none: no notebook, or its kernel is not started). */
  setKernel(kernelId: string | null, notebook: string | null): void {
    if (kernelId === this._kid && notebook === this._notebook) {
      return;
    }
    this._kid = kernelId;
    this._notebook = notebook;
    this._sandbox = null;
    this._tree = null;
    this._error = null;
    this._render();
    void this.refresh();
  }

  get kernelId(): string | null {
    return this._kid;
  }

  get sandbox(): ISandbox | null {
    return this._sandbox;
  }

  protected onAfterShow(): void {
    void this.refresh();
  }

  async refresh(): Promise<void> {
    const kid = this._kid;
    if (!kid || this._busy) {
      return;
    }
    this._busy = true;
    try {
      const [sb, tree] = await Promise.all([api.sandbox(kid), api.tree(kid)]);
      if (kid === this._kid) {
        this._sandbox = sb;
        this._tree = tree;
        this._error = null;
      }
    } catch (e) {
      if (kid === this._kid) {
        this._error = e as SandgateError;
      }
    } finally {
      this._busy = false;
    }
    this._render();
  }

  private _render(): void {
    const root = this.node;
    root.replaceChildren();
    root.appendChild(el('h2', 'sg-Panel-title', 'Sandbox'));
    if (!this._kid) {
      root.appendChild(el('p', 'sg-Panel-empty', this._notebook
        ? `${this._notebook} has no kernel running.`
        : 'Open a notebook to see its kernel\'s sandbox.'));
      return;
    }
    root.appendChild(el('p', 'sg-Panel-notebook', this._notebook || ''));
    const err = this._error;
    if (err && err.status === 404) {
      // The kernel is gone on the gateway (deleted, culled or its ttl ran out).
      root.appendChild(el('p', 'sg-Panel-stale', `Kernel ${this._kid.slice(0, 8)} no longer exists: ${err.message}`));
      return;
    }
    if (err) {
      root.appendChild(el('p', 'sg-Panel-error', err.message));
    }
    const sb = this._sandbox;
    if (!sb) {
      if (!err) {
        root.appendChild(el('p', 'sg-Panel-loading', 'Loading...'));
      }
      return;
    }
    const facts = el('table', 'sg-Panel-facts');
    const used = sb.memory_used_mb != null ? `${sb.memory_used_mb} MB of ` : '';
    const rows: [string, string][] = [
      ['State', sb.state + (sb.state === 'running' ? ` (${sb.execution_state})` : '')],
      ['Driver', sb.driver],
      ['Memory', `${used}${sb.limits.memory_mb} MB limit`],
      ['Age', age(sb.created)],
      ['Kernel', sb.id]
    ];
    if (sb.reason) {
      rows.push(['Reason', sb.reason]);
    }
    for (const [k, v] of rows) {
      const tr = el('tr', '', '', { 'data-field': k.toLowerCase() });
      tr.append(el('th', '', k), el('td', '', v));
      facts.appendChild(tr);
    }
    root.appendChild(facts);

    const bar = el('div', 'sg-Panel-actions');
    const name = el('input', 'sg-Panel-name jp-mod-styled', '', { placeholder: 'checkpoint name (optional)', type: 'text' });
    const cpButton = this._button('Checkpoint', CommandIDs.checkpoint, {}, RUNNING(sb) || AT_REST(sb));
    cpButton.onclick = () => {
      void this._run(CommandIDs.checkpoint, { name: name.value.trim() });
      name.value = '';
    };
    const cpRow = el('div', 'sg-Panel-checkpointRow');
    cpRow.append(name, cpButton);
    bar.appendChild(cpRow);
    for (const a of ACTIONS) {
      bar.appendChild(this._button(a.label, a.command, a.args || {}, a.enabled(sb)));
    }
    root.appendChild(bar);

    root.appendChild(el('h3', 'sg-Panel-subtitle', 'Checkpoints'));
    const cps = this._tree?.checkpoints || [];
    if (!cps.length) {
      root.appendChild(el('p', 'sg-Panel-empty', 'None yet.'));
    }
    root.appendChild(this._treeList(sb, cps, null));
  }

  private _treeList(sb: ISandbox, cps: ICheckpoint[], parent: string | null): HTMLElement {
    const ids = new Set(cps.map(c => c.id));
    const ul = el('ul', 'sg-Panel-tree');
    const children = cps
      .filter(c => (parent === null ? !c.parent || !ids.has(c.parent) : c.parent === parent))
      .sort((a, b) => a.created - b.created);
    for (const c of children) {
      const li = el('li', 'sg-Panel-checkpoint', '', { 'data-checkpoint': c.id });
      const label = el('span', 'sg-Panel-cpname', c.name || c.id.slice(0, 8));
      const when = new Date(c.created * 1000);
      const meta = el('span', 'sg-Panel-cpmeta',
        `${when.toLocaleTimeString()} · ${mib(c.state_bytes + c.files_bytes)}${sb.head === c.id ? ' · head' : ''}`);
      li.append(label, meta);
      for (const a of CHECKPOINT_ACTIONS) {
        li.appendChild(this._button(a.label, a.command, { ...(a.args || {}), checkpoint: c.id }, a.enabled(sb)));
      }
      const forks = (this._tree?.forks || []).filter(f => f.parent === c.id);
      if (forks.length) {
        const fl = el('ul', 'sg-Panel-forks');
        for (const f of forks) {
          fl.appendChild(el('li', 'sg-Panel-fork', `fork ${f.id.slice(0, 8)} (${f.state})`));
        }
        li.appendChild(fl);
      }
      li.appendChild(this._treeList(sb, cps, c.id));
      ul.appendChild(li);
    }
    return ul;
  }

  private _button(label: string, command: string, args: object, enabled: boolean): HTMLButtonElement {
    const b = el('button', 'jp-Button jp-mod-styled jp-mod-reject sg-Panel-button', label, { 'data-command': command });
    b.disabled = !enabled;
    b.onclick = () => void this._run(command, args);
    return b;
  }

  private async _run(command: string, args: object): Promise<void> {
    // Errors become notifications in the command itself.
    await this.commands.execute(command, { ...args, kernelId: this._kid } as any);
    await this.refresh();
  }

  private _kid: string | null = null;
  private _notebook: string | null = null;
  private _sandbox: ISandbox | null = null;
  private _tree: ITree | null = null;
  private _error: SandgateError | null = null;
  private _busy = false;
  private _timer: number;
}
