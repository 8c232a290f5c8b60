package envpool

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
)

// A pristine verification (VERIFIER_MODE_PRISTINE) judges the agent's work without trusting
// its sandbox: the verifier runs in a sandbox forked from the env's initial checkpoint (after
// setup, before any reset hook or agent), into which the env's verifier files (a directory
// below the server's import root) and the agent's copy paths are copied. Its environment is
// the env's, the task's variables (every Reset option and DELTAGYM_SEED), DELTAGYM_ANSWER, and
// the evaluation's env last, so that neither the agent nor an option sets PATH or anything
// the spec names. The agent's processes, files outside the copy paths and secret options
// never meet the verifier's; the verifier sandbox is destroyed after it ran.

// DefaultVerifierFilesPath is where an env's verifier files appear in the verifier's sandbox
// when the spec does not say.
const DefaultVerifierFilesPath = "/verifier"

// verifierFilesLimits bound the copy of an env's verifier files (the operator's, not the
// agent's: a refusal there is the env's fault).
var verifierFilesLimits = sandbox.CopyLimits{MaxBytes: 1 << 30, MaxEntries: 100000}

// TaskLabelPrefix prefixes the checkpoint labels that keep a task's variables (TaskLabels).
const TaskLabelPrefix = "deltagym.task."

// TaskLabels encodes a task's variables as checkpoint labels (nil for none). Labels stay in
// the server's data directory; the API does not show them.
func TaskLabels(task map[string]string) map[string]string {
	if len(task) == 0 {
		return nil
	}
	out := make(map[string]string, len(task))
	for k, v := range task {
		out[TaskLabelPrefix+k] = v
	}
	return out
}

// TaskOf decodes the task variables that checkpoint labels keep (nil for none).
func TaskOf(labels map[string]string) map[string]string {
	var out map[string]string
	for k, v := range labels {
		if name, ok := strings.CutPrefix(k, TaskLabelPrefix); ok {
			if out == nil {
				out = map[string]string{}
			}
			out[name] = v
		}
	}
	return out
}

// Pristine judges the lease's state in a fresh sandbox of its env (see above); answer, when
// set, is DELTAGYM_ANSWER. A copy path the agent made unusable (a symlink, FIFO, socket or
// device, or past the copy caps) gets reward 0 without running the verifier, with
// Verdict.Refused saying why: the agent's fault, not the verifier's. The caller holds the
// lease's turn, so no call of the agent changes the state during the copy.
func (m *Manager) Pristine(ctx context.Context, l *Lease, answer *string) (Verdict, error) {
	env := l.env
	if !env.HasVerifier() {
		return Verdict{}, fmt.Errorf("env %s: %w", env.Name(), ErrNoVerifier)
	}
	from, ok := l.box.(*sandbox.Sandbox)
	if !ok {
		return Verdict{}, fmt.Errorf("env %s: a pristine verifier needs the sandbox runtime's sandboxes: %w", env.Name(), ErrNotReady)
	}
	ckpt := env.InitialCheckpoint()
	if ckpt == "" {
		return Verdict{}, fmt.Errorf("env %s: no initial checkpoint to verify from: %w", env.Name(), ErrNotReady)
	}
	sbs, err := m.rt.Fork(ctx, ckpt, 1, env.forkSpec())
	if err != nil {
		return Verdict{}, fmt.Errorf("env %s: forking the verifier's sandbox: %w", env.Name(), err)
	}
	// Destroyed after the verdict is answered (Close waits for it): unmounting and removing
	// its cgroup are off the call's path.
	defer m.discard.Go(func() {
		if err := sbs[0].Destroy(context.WithoutCancel(ctx)); err != nil {
			m.log.Warn("destroying a verifier's sandbox", "sandbox", sbs[0].ID(), "err", err)
		}
		m.kick()
	})
	to, ok := sbs[0].(*sandbox.Sandbox)
	if !ok {
		return Verdict{}, fmt.Errorf("env %s: a pristine verifier needs the sandbox runtime's sandboxes: %w", env.Name(), ErrNotReady)
	}
	ev := env.spec.GetEvaluation()
	if err := m.copyVerifierFiles(ctx, env, to); err != nil {
		return Verdict{}, err
	}
	lim := sandbox.CopyLimits{MaxBytes: ev.GetMaxCopyBytes(), MaxEntries: int(ev.GetMaxCopyEntries())}
	if _, err := to.CopyFrom(ctx, from, ev.GetCopyPaths(), lim); err != nil {
		if errors.Is(err, sandbox.ErrUncopyable) {
			why := strings.TrimSuffix(err.Error(), ": "+sandbox.ErrUncopyable.Error())
			return Verdict{Refused: why, Output: "deltagym: the agent's state was not judged (reward 0): " + why + "\n"}, nil
		}
		return Verdict{}, fmt.Errorf("env %s: copying the agent's files to the verifier's sandbox: %w", env.Name(), err)
	}
	return m.runVerifier(ctx, env, to, verifierEnv(env.spec, l.Task(), answer))
}

// copyVerifierFiles copies env's verifier files, if it has any, into sb. Any failure is the
// env's (ErrVerifier) or the server's, never the agent's.
func (m *Manager) copyVerifierFiles(ctx context.Context, env *Env, sb *sandbox.Sandbox) error {
	ev := env.spec.GetEvaluation()
	if ev.GetVerifierFiles() == "" {
		return nil
	}
	dir, err := m.openVerifierFiles(ev.GetVerifierFiles())
	if err != nil {
		return fmt.Errorf("env %s: evaluation.verifier_files: %v: %w", env.Name(), err, ErrVerifier)
	}
	defer dir.Close()
	dst := cmp.Or(ev.GetVerifierFilesPath(), DefaultVerifierFilesPath)
	if _, err := sb.CopyDirIn(ctx, dir, dst, verifierFilesLimits); err != nil {
		if errors.Is(err, sandbox.ErrUncopyable) {
			return fmt.Errorf("env %s: copying evaluation.verifier_files: %v: %w", env.Name(), err, ErrVerifier)
		}
		return fmt.Errorf("env %s: copying evaluation.verifier_files: %w", env.Name(), err)
	}
	return nil
}

// openVerifierFiles opens the directory name below the server's import root.
func (m *Manager) openVerifierFiles(name string) (*os.File, error) {
	if m.cfg.OpenVerifierFiles == nil {
		return nil, errors.New("the server reads no files for verifiers (it has no import root)")
	}
	f, err := m.cfg.OpenVerifierFiles(name)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
		f.Close()
		return nil, fmt.Errorf("%q is not a directory", name)
	}
	return f, nil
}

// checkVerifierFiles checks at registration that spec's verifier files can be read.
func (m *Manager) checkVerifierFiles(spec *deltagymv1.EnvSpec) error {
	name := spec.GetEvaluation().GetVerifierFiles()
	if name == "" {
		return nil
	}
	f, err := m.openVerifierFiles(name)
	if err != nil {
		return badField("evaluation.verifier_files", "%v", err)
	}
	return f.Close()
}

// verifierEnv is a pristine verifier's environment over its sandbox's: the task's variables,
// DELTAGYM_ANSWER, then the env's env and the evaluation's env, which win.
func verifierEnv(spec *deltagymv1.EnvSpec, task map[string]string, answer *string) []string {
	vars := make([]string, 0, len(task)+len(spec.GetEnv())+len(spec.GetEvaluation().GetEnv())+1)
	for _, k := range slices.Sorted(maps.Keys(task)) {
		vars = append(vars, k+"="+task[k])
	}
	if answer != nil {
		vars = append(vars, "DELTAGYM_ANSWER="+*answer)
	}
	for _, m := range []map[string]string{spec.GetEnv(), spec.GetEvaluation().GetEnv()} {
		for _, k := range slices.Sorted(maps.Keys(m)) {
			vars = append(vars, k+"="+m[k])
		}
	}
	return vars
}
