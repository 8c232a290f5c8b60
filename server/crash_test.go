package server_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/internal/testenv"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/sandbox/image/imagetest"
	"github.com/deltagym/deltagym/server"
	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

// crashChildEnv holds the JSON config of the server the test binary runs as a crash child.
const crashChildEnv = "DG_SERVER_CRASH_CHILD"

// crashServeEnv, set, makes the crash child print "serving ADDR TOKEN" once it serves, and take
// its calls from the test, instead of resetting a sandbox itself.
const crashServeEnv = "DG_SERVER_CRASH_SERVE"

// crashChild starts a server from the config in crashChildEnv, resets env "plain", prints the
// episode once Postgres has it, and serves until it is killed (with crashServeEnv: serves the
// test's calls).
func crashChild() {
	fail := func(err error) {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	var cfg server.Config
	if err := json.Unmarshal([]byte(os.Getenv(crashChildEnv)), &cfg); err != nil {
		fail(err)
	}
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx := context.Background()
	srv, err := server.New(ctx, cfg)
	if err != nil {
		fail(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail(err)
	}
	go srv.Serve(ln)
	if os.Getenv(crashServeEnv) != "" {
		fmt.Println("serving", ln.Addr().String(), srv.Token())
		select {}
	}
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	c := deltagymv1connect.NewEnvServiceClient(&http.Client{Transport: &http.Transport{Protocols: &protos}}, "http://"+ln.Addr().String(), connect.WithInterceptors(bearer(srv.Token())))
	rr, err := c.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain", Run: "crash"}))
	if err != nil {
		fail(err)
	}
	if _, err := srv.Ledger().Episode(ctx, rr.Msg.EpisodeId); err != nil { // delivered
		fail(err)
	}
	fmt.Println("episode", rr.Msg.EpisodeId, rr.Msg.SandboxId)
	select {}
}

// restartConfig is the configuration of a server that a test starts more than once, on the same
// data directory and Postgres (removed at the test's end); it skips the test unless root.
func restartConfig(t *testing.T) server.Config {
	t.Helper()
	testenv.Privileged(t, "sandboxes use namespaces, mounts and cgroups")
	envs := t.TempDir()
	for name, body := range testEnvs {
		must(t, os.WriteFile(filepath.Join(envs, name), []byte(body), 0o644))
	}
	data, err := os.MkdirTemp("", "dgrestart")
	must(t, err)
	cg := fmt.Sprintf("dgsrvtest%d_%d", os.Getpid(), serverCount.Add(1))
	t.Cleanup(func() {
		if err := sandbox.Purge(filepath.Join(data, "sandbox")); err != nil {
			t.Errorf("purging sandbox data: %v", err)
		}
		os.RemoveAll(data)
		removeCgroupRoot(cg)
	})
	return server.Config{DataDir: data, EnvsDir: envs, InitBinary: initBinary(t), CRIU: criuBinary(), CgroupRoot: cg,
		DefaultImageDir: imagetest.Busybox(t), Lease: server.LeaseSettings{TTL: time.Minute}, DatabaseURL: pgtest.Start(t)}
}

// An episode running when its server is killed ends failed (infra) once the server is back, as
// a graceful shutdown ends it; its sandbox ended with the server.
func TestCrashEndsEpisodes(t *testing.T) {
	cfg := restartConfig(t)
	raw, err := json.Marshal(cfg)
	must(t, err)
	child := exec.Command(os.Args[0])
	child.Env = append(os.Environ(), crashChildEnv+"="+string(raw))
	child.Stderr = os.Stderr
	out, err := child.StdoutPipe()
	must(t, err)
	must(t, child.Start())
	line, err := bufio.NewReader(out).ReadString('\n')
	_ = child.Process.Signal(syscall.SIGKILL)
	_ = child.Wait()
	f := strings.Fields(line)
	if err != nil || len(f) != 3 || f[0] != "episode" {
		t.Fatalf("crash child said %q (%v)", line, err)
	}
	episode, box := f[1], f[2]

	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	srv, err := server.New(ctx, cfg)
	must(t, err)
	defer func() {
		if err := srv.Close(context.Background()); err != nil {
			t.Errorf("closing server: %v", err)
		}
	}()
	if ended := srv.Runtime().Ended(); len(ended) == 0 || !strings.Contains(strings.Join(ended, " "), box) {
		t.Fatalf("sandboxes ended with the crash: %v, want %s among them", ended, box)
	}
	e, err := srv.Ledger().Episode(ctx, episode)
	must(t, err)
	if e.Status != ledger.StatusFailed || e.FailureClass != ledger.FailureInfra || e.EndedAt == nil || e.Sandbox != box {
		t.Fatalf("episode after the crash: %+v, want failed (infra), ended, in %s", e, box)
	}
	if !strings.Contains(e.FailureMessage, "server ended") {
		t.Fatalf("episode after the crash: failure message %q", e.FailureMessage)
	}
	// A call on the lost sandbox says what became of it.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	go srv.Serve(ln)
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	c := deltagymv1connect.NewEnvServiceClient(&http.Client{Transport: &http.Transport{Protocols: &protos}}, "http://"+ln.Addr().String(), connect.WithInterceptors(bearer(srv.Token())))
	_, err = c.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: box,
		Action: &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{Command: "true"}}}}))
	if connect.CodeOf(err) != connect.CodeNotFound || !strings.Contains(err.Error(), "previous run") {
		t.Fatalf("a step on the sandbox lost in the crash: %v, want NotFound saying it ended with the previous run", err)
	}
}

// startServing starts a server on cfg, serving on a loopback port, and returns it with an
// EnvService client (HTTP/2 without TLS, as bidi streams need).
func startServing(t *testing.T, ctx context.Context, cfg server.Config) (*server.Server, deltagymv1connect.EnvServiceClient) {
	t.Helper()
	srv, err := server.New(ctx, cfg)
	must(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	go srv.Serve(ln)
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	return srv, deltagymv1connect.NewEnvServiceClient(&http.Client{Transport: &http.Transport{Protocols: &protos}}, "http://"+ln.Addr().String(), connect.WithInterceptors(bearer(srv.Token())))
}

// A checkpoint taken before a restart is restored after it with its steps numbered as before,
// and forked into its run and group: the checkpoint's record keeps where it was taken, with
// the ledger on or off.
func TestRestoreAfterRestartNumbersSteps(t *testing.T) {
	for _, withLedger := range []bool{true, false} {
		t.Run(fmt.Sprintf("ledger=%v", withLedger), func(t *testing.T) {
			cfg := restartConfig(t)
			if !withLedger {
				cfg.DatabaseURL, cfg.NoLedger = "", true
			}
			restoreAfterRestart(t, cfg, nil)
		})
	}
	// A checkpoint whose record keeps no labels (as a server that kept places only in its
	// ledger wrote it) gets its place from the ledger at start.
	t.Run("labels from the ledger", func(t *testing.T) {
		cfg := restartConfig(t)
		restoreAfterRestart(t, cfg, func(ck string) {
			record := filepath.Join(cfg.DataDir, "sandbox", "store", "meta", "checkpoints", ck+".json")
			raw, err := os.ReadFile(record)
			must(t, err)
			var m map[string]any
			must(t, json.Unmarshal(raw, &m))
			if _, ok := m["labels"]; !ok {
				t.Fatalf("the checkpoint's record has no labels: %s", raw)
			}
			delete(m, "labels")
			raw, err = json.Marshal(m)
			must(t, err)
			must(t, os.WriteFile(record, raw, 0o600))
		})
	})
}

// restoreAfterRestart checkpoints an episode after 3 steps, restarts the server (calling
// between, if set, with the checkpoint's id while it is stopped) and checks that the
// checkpoint's place survived.
func restoreAfterRestart(t *testing.T, cfg server.Config, between func(ck string)) {
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	start := func() (*server.Server, deltagymv1connect.EnvServiceClient) { return startServing(t, ctx, cfg) }
	exec := func(c deltagymv1connect.EnvServiceClient, sb string) *deltagymv1.StepResponse {
		st, err := c.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("true")}))
		must(t, err)
		return st.Msg
	}

	srv, c := start()
	rr, err := c.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain", Run: "restart", GroupId: "g"}))
	must(t, err)
	sb := rr.Msg.GetSandboxId()
	for range 3 {
		exec(c, sb)
	}
	ck, err := c.Checkpoint(ctx, connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: sb}))
	must(t, err)
	before, err := c.Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: ck.Msg.GetCheckpointId()}))
	must(t, err)
	if before.Msg.GetNextStepIndex() != 3 {
		t.Fatalf("before the restart: next step %d, want 3", before.Msg.GetNextStepIndex())
	}
	must(t, srv.Close(ctx))
	if between != nil {
		between(ck.Msg.GetCheckpointId())
	}

	srv, c = start()
	defer func() {
		if err := srv.Close(context.Background()); err != nil {
			t.Errorf("closing server: %v", err)
		}
	}()
	rr, err = c.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain", Run: "restart"}))
	must(t, err)
	sb = rr.Msg.GetSandboxId()
	after, err := c.Restore(ctx, connect.NewRequest(&deltagymv1.RestoreRequest{SandboxId: sb, CheckpointId: ck.Msg.GetCheckpointId()}))
	must(t, err)
	if after.Msg.GetNextStepIndex() != 3 {
		t.Fatalf("after the restart: next step %d, want 3 as before", after.Msg.GetNextStepIndex())
	}
	st := exec(c, sb)
	if got := st.GetStepIndex(); got != 3 {
		t.Fatalf("the step after the restart has index %d, want 3", got)
	}
	f, err := c.Fork(ctx, connect.NewRequest(&deltagymv1.ForkRequest{Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: ck.Msg.GetCheckpointId()}, N: 1}))
	must(t, err)
	kid, err := c.GetSandbox(ctx, connect.NewRequest(&deltagymv1.GetSandboxRequest{SandboxId: f.Msg.GetSandboxIds()[0]}))
	must(t, err)
	if k := kid.Msg.GetSandbox(); k.GetRun() != "restart" || k.GetGroupId() != "g" || k.GetNextStepIndex() != 3 {
		t.Fatalf("a fork of the checkpoint after the restart: %v, want run restart, group g, next step 3", k)
	}
	if srv.Ledger() == nil {
		return
	}
	traj, err := srv.Ledger().Trajectory(ctx, st.GetEpisodeId())
	must(t, err)
	if n := len(traj.Steps); n != 4 || !traj.Steps[0].Inherited || !traj.Steps[1].Inherited || !traj.Steps[2].Inherited || traj.Steps[3].Inherited {
		t.Fatalf("trajectory after the restart: %d steps (%+v), want 3 inherited and 1 own", n, traj.Steps)
	}
}

// Envs registered over the API are served again after a restart, a replaced catalog env as
// replaced; a refused registration leaves nothing behind.
func TestRegisteredEnvsKept(t *testing.T) {
	cfg := restartConfig(t)
	cfg.NoLedger, cfg.DatabaseURL = true, ""
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	start := func() (*server.Server, deltagymv1connect.EnvServiceClient) { return startServing(t, ctx, cfg) }
	register := func(c deltagymv1connect.EnvServiceClient, spec *deltagymv1.EnvSpec, replace bool) error {
		_, err := c.RegisterEnv(ctx, connect.NewRequest(&deltagymv1.RegisterEnvRequest{Spec: spec, Replace: replace}))
		return err
	}
	kept := &deltagymv1.EnvSpec{Name: "kept", Image: "default", PoolSize: 1, Env: map[string]string{"WHO": "kept"}}
	plain := &deltagymv1.EnvSpec{Name: "plain", Image: "default", PoolSize: 1, Env: map[string]string{"WHO": "replaced"}}

	srv, c := start()
	must(t, register(c, kept, false))
	must(t, register(c, plain, true))
	if err := register(c, &deltagymv1.EnvSpec{Name: "kept", Image: "other"}, false); codeOf(err) != connect.CodeAlreadyExists {
		t.Fatalf("registering kept again: %v, want AlreadyExists", err)
	}
	if err := register(c, &deltagymv1.EnvSpec{Name: "Bad Name", Image: "default"}, false); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("registering a bad name: %v, want InvalidArgument", err)
	}
	must(t, srv.Close(ctx))
	files, err := os.ReadDir(filepath.Join(cfg.DataDir, "envs"))
	must(t, err)
	var names []string
	for _, f := range files {
		names = append(names, f.Name())
	}
	if strings.Join(names, " ") != "kept.json plain.json" {
		t.Fatalf("kept files %v, want kept.json plain.json and nothing else", names)
	}
	// What a crash or a later server may leave: a temporary file, a spec this one refuses.
	envsDir := filepath.Join(cfg.DataDir, "envs")
	must(t, os.WriteFile(filepath.Join(envsDir, ".register-123"), []byte("{"), 0o600))
	must(t, os.WriteFile(filepath.Join(envsDir, "bad.json"), []byte(`{"name": "bad"}`), 0o600)) // no image

	srv, c = start()
	defer func() {
		if err := srv.Close(context.Background()); err != nil {
			t.Errorf("closing server: %v", err)
		}
	}()
	le, err := c.ListEnvs(ctx, connect.NewRequest(&deltagymv1.ListEnvsRequest{}))
	must(t, err)
	got := map[string]*deltagymv1.EnvSpec{}
	for _, e := range le.Msg.GetEnvs() {
		got[e.GetSpec().GetName()] = e.GetSpec()
	}
	for _, want := range []*deltagymv1.EnvSpec{kept, plain} {
		if !proto.Equal(got[want.GetName()], want) {
			t.Fatalf("after the restart, env %s is %v, want %v", want.GetName(), got[want.GetName()], want)
		}
	}
	if got["bad"] != nil {
		t.Fatal("the bad kept spec is served")
	}
	files, err = os.ReadDir(envsDir)
	must(t, err)
	names = nil
	for _, f := range files {
		names = append(names, f.Name())
	}
	if strings.Join(names, " ") != "bad.json.bad kept.json plain.json" {
		t.Fatalf("kept files after the restart %v, want the bad one set aside and the temporary one gone", names)
	}
	for env, who := range map[string]string{"kept": "kept\n", "plain": "replaced\n"} {
		rr, err := c.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: env}))
		must(t, err)
		st, err := c.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: rr.Msg.GetSandboxId(), Action: execAction("echo $WHO")}))
		must(t, err)
		if out := stdout(t, st.Msg); out != who {
			t.Fatalf("env %s after the restart: WHO=%q, want %q", env, out, who)
		}
	}
}
