package server_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/server"
)

// acked is what the clients of a killed server were answered: the rows those answers imply.
type acked struct {
	mu    sync.Mutex
	steps map[string][]int // episode → indices of the steps answered
	ckpts []string         // checkpoints answered
}

func (a *acked) step(ep string, index int) {
	a.mu.Lock()
	a.steps[ep] = append(a.steps[ep], index)
	a.mu.Unlock()
}

func (a *acked) checkpoint(id string) {
	a.mu.Lock()
	a.ckpts = append(a.ckpts, id)
	a.mu.Unlock()
}

// A server killed with SIGKILL in the middle of a load of concurrent Steps (some checkpointing
// after the step) and Checkpoints loses none of the rows it answered for: once it is back and
// the spool is delivered, Postgres has every episode, step and checkpoint a client got an
// answer about. The kill comes right after an answer, when the rows of the last answers are
// the newest in the spool.
func TestSIGKILLKeepsAcknowledgedRows(t *testing.T) {
	for _, sync := range []bool{false, true} {
		t.Run(fmt.Sprintf("ledger-sync=%v", sync), func(t *testing.T) {
			cfg := restartConfig(t)
			cfg.LedgerSync = sync
			killUnderLoad(t, cfg)
		})
	}
}

func killUnderLoad(t *testing.T, cfg server.Config) {
	raw, err := json.Marshal(cfg)
	must(t, err)
	child := exec.Command(os.Args[0])
	child.Env = append(os.Environ(), crashChildEnv+"="+string(raw), crashServeEnv+"=1")
	child.Stderr = os.Stderr
	out, err := child.StdoutPipe()
	must(t, err)
	must(t, child.Start())
	killed := false
	kill := func() {
		if !killed {
			killed = true
			_ = child.Process.Signal(syscall.SIGKILL)
			_ = child.Wait()
		}
	}
	defer kill()
	line, err := bufio.NewReader(out).ReadString('\n')
	f := strings.Fields(line)
	if err != nil || len(f) != 3 || f[0] != "serving" {
		t.Fatalf("crash child said %q (%v)", line, err)
	}
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	c := deltagymv1connect.NewEnvServiceClient(&http.Client{Transport: &http.Transport{Protocols: &protos}}, "http://"+f[1],
		connect.WithInterceptors(bearer(f[2])))

	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	const clients, killAfter = 4, 300
	got := &acked{steps: map[string][]int{}}
	var episodes []string
	var boxes []string
	for range clients {
		rr, err := c.Reset(ctx, connect.NewRequest(&deltagymv1.ResetRequest{Env: "plain", Run: "kill"}))
		must(t, err)
		episodes = append(episodes, rr.Msg.GetEpisodeId())
		boxes = append(boxes, rr.Msg.GetSandboxId())
	}
	var answers atomic.Int64
	var killOnce sync.Once
	var wg sync.WaitGroup
	for _, sb := range boxes {
		wg.Go(func() {
			for i := 0; ; i++ {
				var err error
				if i%4 == 3 {
					var ck *connect.Response[deltagymv1.CheckpointResponse]
					if ck, err = c.Checkpoint(ctx, connect.NewRequest(&deltagymv1.CheckpointRequest{SandboxId: sb})); err == nil {
						got.checkpoint(ck.Msg.GetCheckpointId())
					}
				} else {
					var st *connect.Response[deltagymv1.StepResponse]
					if st, err = c.Step(ctx, connect.NewRequest(&deltagymv1.StepRequest{SandboxId: sb, Action: execAction("true"), Checkpoint: i%4 == 1})); err == nil {
						got.step(st.Msg.GetEpisodeId(), int(st.Msg.GetStepIndex()))
						if id := st.Msg.GetCheckpointId(); id != "" {
							got.checkpoint(id)
						}
					}
				}
				if err != nil {
					return // the server is gone
				}
				if answers.Add(1) == killAfter {
					killOnce.Do(func() { _ = child.Process.Signal(syscall.SIGKILL) })
				}
			}
		})
	}
	wg.Wait()
	kill()
	if answers.Load() < killAfter {
		t.Fatalf("the load stopped after %d answers, before the kill", answers.Load())
	}

	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	srv, err := server.New(ctx, cfg)
	must(t, err)
	defer func() {
		if err := srv.Close(context.Background()); err != nil {
			t.Errorf("closing server: %v", err)
		}
	}()
	// The store's queries deliver the spool first.
	var lost []string
	steps := 0
	for _, ep := range episodes {
		tr, err := srv.Ledger().Trajectory(ctx, ep)
		if err != nil {
			lost = append(lost, fmt.Sprintf("episode %s (%v)", ep, err))
			continue
		}
		have := map[int]bool{}
		for _, s := range tr.Steps {
			have[s.Index] = true
		}
		for _, i := range got.steps[ep] {
			steps++
			if !have[i] {
				lost = append(lost, fmt.Sprintf("step %d of %s", i, ep))
			}
		}
	}
	for _, id := range got.ckpts {
		if _, err := srv.Ledger().CheckpointPlace(ctx, id); err != nil {
			lost = append(lost, fmt.Sprintf("checkpoint %s (%v)", id, err))
		}
	}
	t.Logf("killed after %d answers: %d steps and %d checkpoints answered", answers.Load(), steps, len(got.ckpts))
	if len(lost) > 0 {
		t.Fatalf("%d answered rows missing from the ledger after the restart: %s", len(lost), strings.Join(lost, "; "))
	}
}
