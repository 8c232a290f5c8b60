package procstate

import (
	"fmt"
	"os"
	"strings"

	"github.com/deltagym/deltagym/sandbox/ptfork"
)

// Checkpoint is what a checkpoint keeps of its processes, with its id and
// the sandbox whose templates it holds. The runtime's record of a
// checkpoint embeds it: its fields are the record's, in its JSON too.
type Checkpoint struct {
	ID        string `json:"id"`
	SandboxID string `json:"sandbox,omitempty"`
	// Procs are the templates of the processes that ran at the checkpoint,
	// held by sandbox SandboxID.
	Procs []Template `json:"procs,omitempty"`
	// TplGroup names the frozen cgroup of the templates, a sub-group of
	// the sandbox's: a server restarted after a crash finds them there.
	TplGroup string `json:"tpl_group,omitempty"`
	// Images are the process trees saved by CRIU (criu.go).
	Images []Unit `json:"images,omitempty"`
	// TplImages are CRIU images of the templates (image.go), made once
	// when needed. The runtime guards them with its lock.
	TplImages []Unit `json:"tpl_images,omitempty"`
}

// Template is the persisted record of one template.
type Template struct {
	HostPid int    `json:"host_pid"`
	Start   uint64 `json:"start"` // start time, guards against pid reuse
	NSPid   int    `json:"ns_pid"`
	Comm    string `json:"comm"`
	Cwd     string `json:"cwd"`
	Files   []File `json:"files,omitempty"`
	Session string `json:"session,omitempty"`
	// Attached is the state of the session whose shell this is, when the
	// shell ran an interactive command (the session was attached to it).
	Attached *Attached `json:"attached,omitempty"`
	// Leader is set when the process led its own session (as every
	// command does): its copies call setsid, so that they lead one too.
	Leader bool `json:"leader,omitempty"`
	// Dumpable is the process's dumpable flag (PR_GET_DUMPABLE) when it was
	// captured; its template is kept non-dumpable (guardTemplate) and its
	// copies get the flag back. 0 in records that predate the guard, whose
	// templates kept the process's flag.
	Dumpable int `json:"dumpable,omitempty"`
	// Threads is the process's number of threads when it has more than
	// one; each copy has as many.
	Threads int `json:"threads,omitempty"`
	// Itimer is the process's ITIMER_REAL (struct itimerval: interval
	// seconds and microseconds, then what was left of the value) when it
	// ran; each copy is given it (a fork does not inherit it).
	Itimer [4]int64 `json:"itimer,omitzero"`
	// alarm: SIGALRM is handled, ignored or blocked, so Itimer is read.
	alarm bool
	// Shares names a file of /dev/shm the process maps shared and writable
	// and had removed (a POSIX semaphore, multiprocessing's shared
	// memory): CRIU cannot bring it back in a sandbox, so the process is a
	// template all the same, and its copies share that memory with it.
	Shares string `json:"shares,omitempty"`
	// Private are the descriptions each copy gets its own of (private.go).
	Private []Private `json:"private,omitempty"`
	// KernelWrites are the ranges of its memory the kernel wrote that hold
	// no state of the program (kernelwrites.go), sorted; the processes
	// digest leaves them out.
	KernelWrites []Span `json:"kernel_writes,omitempty"`
	// Waits are the waits with a time left its threads rested in, which
	// its copies rest in too.
	Waits []Wait `json:"waits,omitempty"`
	// sessionPipes are the keys (pipe:[inode]) of the session's stdin,
	// stdout and stderr pipes at the capture, for a session's shell whose
	// server gave them (SessionShell.Pipes).
	sessionPipes [3]string
	// threads are the template's threads' states (ptfork.ThreadStates),
	// given to each copy without reading them again; nil once the record
	// is read back from disk, when they are read.
	threads ptfork.ThreadStates
}

// SessionShell is a session's shell as a checkpoint records it: the
// session's name, and its state if it is attached.
type SessionShell struct {
	Name     string
	Attached *Attached
	// Pipes are the keys (pipe:[inode]) of the session's stdin, stdout
	// and stderr pipes, "" where the server does not know them.
	Pipes [3]string
}

// Attached is the state of a session attached to an interactive command
// (sandbox.Interact) that its shell runs: the nonce of the sentinel the
// shell prints when the command ends (the shell read it at the command's
// start), and the command's output read past the last call's answer, the
// next call's. A shell brought back in this state is the session's,
// attached to the command brought back with it.
type Attached struct {
	Nonce   string `json:"nonce"`
	Pending []byte `json:"pending,omitempty"`
}

// File is a file a template has open in the sandbox's root.
type File struct {
	FD    int    `json:"fd"`
	Path  string `json:"path"`
	Flags int    `json:"flags"`
	Pos   int64  `json:"pos"`
	// DupOf is 1 + the lower descriptor of the process that is the same
	// open file (`2>&1`), which a copy dups rather than opens again, so
	// that the two keep one offset; 0 if none is.
	DupOf int `json:"dup_of,omitempty"`
}

func (t Template) name() string { return fmt.Sprintf("pid %d (%s)", t.NSPid, t.Comm) }

func Names(tpls []Template) string {
	names := make([]string, len(tpls))
	for i, p := range tpls {
		names[i] = p.name()
	}
	return strings.Join(names, ", ")
}

// Unit is one process tree of a checkpoint saved as a CRIU image.
type Unit struct {
	Dir   string     `json:"dir"` // images, under store/criu
	Procs []UnitProc `json:"procs"`
	Why   string     `json:"why"` // why the fast path did not take it
	// Session names the session whose shell is the root, if any, and
	// Pipes the keys (pipe:[inode]) of its stdin, stdout and stderr, the
	// server's pipes, replaced by fresh ones at restore.
	Session string    `json:"session,omitempty"`
	Pipes   [3]string `json:"pipes,omitzero"`
	// Attached is the session's state when its shell ran an interactive
	// command (Template.Attached).
	Attached *Attached `json:"attached,omitempty"`
	// Ext are the files the tree reached on a detached mount.
	Ext []ExtFile `json:"ext,omitempty"`
	// Stopped is set when the image is of a stopped task (made from a
	// template): the restore lets it go on.
	Stopped bool `json:"stopped,omitempty"`
	// Bytes is the size of the images, charged to the checkpoint budget.
	Bytes int64 `json:"bytes,omitempty"`
	// Local names a file of the sandbox's /dev/shm a process of the
	// images has open or mapped (reach.local): if it was removed while
	// held, the images restore in no sandbox (the sandbox looks).
	Local string `json:"local,omitempty"`
}

// dirBytes is the size of the files in dir (not recursive: criu writes
// its images flat).
func dirBytes(dir string) int64 {
	ents, _ := os.ReadDir(dir)
	var n int64
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
	}
	return n
}

// UnitProc is one process of a tree, as the checkpoint saw it.
type UnitProc struct {
	NSPid int    `json:"ns_pid"`
	Comm  string `json:"comm"`
}

// ExtFile is a file a tree reaches on an earlier root of the sandbox: a
// process brought back from a template maps the libraries and program of
// the root it was first started in, a mount the root swaps have detached
// since, which criu cannot find. The dump names each such file external
// and the restore hands in the same path opened in the restored root. The
// swaps move every other mount (/dev, /proc) to the new root, so only the
// root's files are ever on a detached mount, and their paths (relative to
// that mount's root) are paths in the sandbox.
type ExtFile struct {
	Key  string `json:"key"`  // file[<mount id>:<inode>], hex, as criu names it
	Path string `json:"path"` // in the sandbox
	Dir  bool   `json:"dir,omitempty"`
}
