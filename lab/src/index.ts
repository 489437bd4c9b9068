// Sandgate in JupyterLab: the Sandbox panel (right sidebar) and the kernel's workspace as
// a drive with its own file browser (left sidebar), both following the current notebook.
import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, InputDialog, Notification, showErrorMessage } from '@jupyterlab/apputils';
import { PathExt } from '@jupyterlab/coreutils';
import { IDocumentManager } from '@jupyterlab/docmanager';
import { FileBrowser, FilterFileBrowserModel, Uploader } from '@jupyterlab/filebrowser';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { folderIcon, LabIcon, refreshIcon, ToolbarButton } from '@jupyterlab/ui-components';
import { Panel, Widget } from '@lumino/widgets';

import { api, SandgateError } from './api';
import { SandboxDrive } from './drive';
import { CommandIDs, SandboxPanel } from './panel';

// A box with a branch: the sandbox and its forks.
const sandboxIcon = new LabIcon({
  name: 'sandgate:sandbox',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
    '<path d="M3 4h12v10H3zm2 2v6h8V6z"/><path d="M17 8h2v6.2a3 3 0 1 1-2 0zM18 16a1 1 0 1 0 0 2 1 1 0 0 0 0-2z"/>' +
    '<path d="M8 16h2v2.2a3 3 0 1 1-2 0zM9 20a1 1 0 1 0 0 .01z"/></g></svg>'
});

/** The workspace sidebar: a header and the file browser of the current kernel's drive. */
class WorkspaceSidebar extends Panel {
  constructor() {
    super();
    this.id = 'sandgate-workspace';
    this.addClass('sg-Workspace');
    this.title.icon = folderIcon;
    this.title.caption = 'Sandbox workspace (the kernel\'s /workspace)';
    this.header = new Widget({ node: document.createElement('div') });
    this.header.addClass('sg-Workspace-header');
    this.addWidget(this.header);
    this.show_(null, null);
  }

  show_(browser: FileBrowser | null, label: string | null): void {
    if (this.browser && this.browser !== browser) {
      this.browser.parent = null;
    }
    this.browser = browser;
    this.header.node.textContent = label || 'No notebook kernel: its sandbox\'s /workspace appears here.';
    if (browser && browser.parent !== this) {
      this.addWidget(browser);
      if (this.isVisible) {
        void browser.model.refresh();
      }
    }
  }

  protected onAfterShow(): void {
    void this.browser?.model.refresh();
  }

  header: Widget;
  browser: FileBrowser | null = null;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'sandgate-lab:plugin',
  description: 'The kernel\'s Sandgate sandbox: checkpoints, forks, pause, and its workspace as a drive',
  autoStart: true,
  requires: [INotebookTracker, IDocumentManager, ILabShell],
  optional: [ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    docManager: IDocumentManager,
    shell: ILabShell,
    palette: ICommandPalette | null
  ) => {
    const panel = new SandboxPanel(app.commands);
    panel.title.icon = sandboxIcon;
    shell.add(panel, 'right', { rank: 900 });
    const workspace = new WorkspaceSidebar();
    shell.add(workspace, 'left', { rank: 150 });

    const browsers = new Map<string, FileBrowser>();
    const browserFor = (kid: string): FileBrowser => {
      let browser = browsers.get(kid);
      if (!browser) {
        const drive = new SandboxDrive(kid);
        app.serviceManager.contents.addDrive(drive);
        // Any files call counts as use of the sandbox (and resumes a paused one): the listing
        // is polled only while the workspace sidebar is shown.
        const model = new FilterFileBrowserModel({
          manager: docManager,
          driveName: drive.name,
          refreshInterval: 5000,
          refreshStandby: () => !workspace.isVisible || 'when-hidden'
        });
        browser = new FileBrowser({ id: `sandgate-workspace-${drive.name}`, model });
        browser.toolbar.addItem('upload', new Uploader({ model }));
        browser.toolbar.addItem('refresh', new ToolbarButton({
          icon: refreshIcon,
          tooltip: 'Refresh the workspace',
          onClick: () => void model.refresh()
        }));
        browsers.set(kid, browser);
      }
      return browser;
    };

    const kernelOf = (nb: NotebookPanel | null): string | null =>
      nb?.sessionContext.session?.kernel?.id ?? null;

    const update = () => {
      const nb = tracker.currentWidget;
      const kid = kernelOf(nb);
      panel.setKernel(kid, nb ? nb.context.path : null);
      if (kid) {
        const browser = browserFor(kid);
        workspace.show_(browser, `/workspace of kernel ${kid.slice(0, 8)} (${PathExt.basename(nb!.context.path)})`);
      } else {
        workspace.show_(null, null);
      }
    };
    // Files a cell writes show up when it finishes, not only at the next poll.
    const onStatus = (ctx: any, status: string) => {
      const browser = workspace.browser;
      if (status === 'idle' && browser && workspace.isVisible) {
        void browser.model.refresh();
      }
    };
    const watched = new WeakSet<NotebookPanel>();
    tracker.widgetAdded.connect((_, nb) => {
      if (!watched.has(nb)) {
        watched.add(nb);
        nb.sessionContext.kernelChanged.connect(update);
        nb.sessionContext.statusChanged.connect(onStatus);
      }
    });
    tracker.currentChanged.connect(update);
    update();

    /** The kernel a command acts on: the one it was given, else the current notebook's. */
    const target = (args: any): string => {
      const kid = (args.kernelId as string) || kernelOf(tracker.currentWidget);
      if (!kid) {
        throw new SandgateError('No notebook with a running kernel is selected', 0);
      }
      return kid;
    };
    const notebookOf = (kid: string): NotebookPanel | null =>
      tracker.find(nb => kernelOf(nb) === kid) ?? null;

    /** Runs fn and shows its failure, with the gateway's message, as a notification. */
    const guarded = (what: string, fn: (args: any) => Promise<void>) => async (args: any) => {
      try {
        await fn(args);
      } catch (e) {
        const msg = e instanceof Error ? e.message : String(e);
        // Lab cuts a toast's text short; the gateway's messages can be long.
        Notification.error(`${what} failed: ${msg}`, {
          autoClose: false,
          actions: [{
            label: 'Details',
            callback: () => void showErrorMessage(`${what} failed`, { message: msg })
          }]
        });
      } finally {
        void panel.refresh();
      }
    };

    app.commands.addCommand(CommandIDs.checkpoint, {
      label: 'Sandbox: Checkpoint the Kernel',
      caption: 'Save the kernel\'s running state (memory and workspace files)',
      execute: guarded('Checkpoint', async args => {
        const kid = target(args);
        let name: string | undefined = args.name;
        if (name === undefined) {
          const answer = await InputDialog.getText({ title: 'Checkpoint name (optional)', placeholder: 'before the big join' });
          if (!answer.button.accept) {
            return;
          }
          name = answer.value || '';
        }
        const cp = await api.checkpoint(kid, name || undefined);
        Notification.success(`Checkpoint ${cp.name || cp.id.slice(0, 8)} taken`, { autoClose: 3000 });
      })
    });

    app.commands.addCommand(CommandIDs.fork, {
      label: args => (args.checkpoint ? 'Sandbox: Fork from This Checkpoint' : 'Sandbox: Fork the Kernel'),
      caption: 'A copy of the notebook, next to it, attached to a copy of its kernel',
      execute: guarded('Fork', async args => {
        const kid = target(args);
        let checkpoint: string | undefined = args.checkpoint;
        if (checkpoint === undefined && args.ask !== false && !args.kernelId) {
          // From the palette: now, or one of the checkpoints.
          const cps = await api.checkpoints(kid);
          const now = 'now (its current state)';
          const items = [now, ...cps.sort((a, b) => b.created - a.created).map(c => `${c.name || c.id.slice(0, 8)} · ${c.id}`)];
          const answer = await InputDialog.getItem({ title: 'Fork the kernel from', items });
          if (!answer.button.accept || !answer.value) {
            return;
          }
          checkpoint = answer.value === now ? undefined : answer.value.split(' · ').pop();
        }
        const nb = notebookOf(kid);
        const fork = await api.fork(kid, checkpoint);
        if (!nb) {
          Notification.info(`Forked kernel ${fork.id.slice(0, 8)}; its notebook is not open here`, { autoClose: 5000 });
          return;
        }
        // The copy holds what the notebook shows now (its outputs included), saved next to it.
        const path = nb.context.path;
        const ext = PathExt.extname(path);
        const copy = PathExt.join(PathExt.dirname(path), `${PathExt.basename(path, ext)}-fork-${fork.id.slice(0, 8)}${ext}`);
        await app.serviceManager.contents.save(copy, {
          type: 'notebook', format: 'json', content: nb.content.model!.toJSON()
        });
        docManager.open(copy, 'Notebook', { id: fork.id, name: nb.sessionContext.session?.kernel?.name }, {
          mode: 'split-right', ref: nb.id
        });
      })
    });

    const pause = (mode: 'disk' | 'memory') =>
      guarded('Pause', async args => {
        await api.pause(target(args), mode);
      });
    app.commands.addCommand(CommandIDs.pauseDisk, {
      label: 'Sandbox: Pause the Kernel to Disk',
      caption: 'Memory freed, state on disk; the next cell resumes it',
      execute: pause('disk')
    });
    app.commands.addCommand(CommandIDs.pauseMemory, {
      label: 'Sandbox: Pause the Kernel in Memory',
      caption: 'Frozen in place; resumes in milliseconds',
      execute: pause('memory')
    });
    app.commands.addCommand(CommandIDs.resume, {
      label: 'Sandbox: Resume the Kernel',
      execute: guarded('Resume', async args => {
        await api.resume(target(args));
      })
    });
    app.commands.addCommand(CommandIDs.showPanel, {
      label: 'Sandbox: Show the Sandbox Panel',
      execute: () => shell.activateById(panel.id)
    });
    app.commands.addCommand(CommandIDs.showWorkspace, {
      label: 'Sandbox: Show the Kernel\'s Workspace Files',
      execute: () => shell.activateById(workspace.id)
    });

    if (palette) {
      const category = 'Sandgate';
      for (const command of Object.values(CommandIDs)) {
        palette.addItem({ command, category });
      }
    }
  }
};

export default plugin;
