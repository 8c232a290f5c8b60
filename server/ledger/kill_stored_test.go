package ledger_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

// childStoredEnv, set ("write" or "sync"), makes the kill child storedChild.
const childStoredEnv = "DELTAGYM_LEDGER_KILL_STORED"

// storedChild is the process TestSIGKILLKeepsStoredRows kills: storedCallers goroutines each
// append a step and a reward of their own episode, a digest and a graph edge of a checkpoint
// of the step, call Stored, and only then print
// "stored EPISODE INDEX", as the server answers a step.
func storedChild() int {
	w, err := ledger.NewWriter(ledger.Config{URL: os.Getenv(childURLEnv), SpoolDir: os.Getenv(childEnv), Logger: quiet,
		Sync: os.Getenv(childStoredEnv) == "sync", PageCache: os.Getenv(childStoredEnv) == "write"})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var out sync.Mutex
	for c := range storedCallers {
		go func() {
			ep := fmt.Sprintf("%s-%d", os.Getenv(childEpisodeEnv), c)
			if err := w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env"}); err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
			for i := 0; ; i++ {
				step := i
				err := w.Step(ledger.StepRow{EpisodeID: ep, Index: i, Action: json.RawMessage(`"a"`), Observation: []byte("obs")})
				if err == nil {
					err = w.Reward(ledger.RewardRow{EpisodeID: ep, StepIndex: &step, Source: "verifier", Value: 1})
				}
				// The checkpoint graph's rows: a digest of each step's checkpoint and an edge
				// from the one before.
				ck := fmt.Sprintf("%s/c%d", ep, i)
				if err == nil {
					err = w.CheckpointDigest(ck, ledger.Digest{Files: "sha256:" + strings.Repeat("0", 64)})
				}
				if err == nil && i > 0 {
					err = w.CheckpointEdge(ledger.CheckpointEdge{ChildID: ck, ParentID: fmt.Sprintf("%s/c%d", ep, i-1)})
				}
				if err == nil {
					err = w.Stored(context.Background())
				}
				if err != nil {
					fmt.Fprintln(os.Stderr, err)
					os.Exit(1)
				}
				out.Lock()
				fmt.Fprintf(os.Stdout, "stored %s %d\n", ep, i)
				out.Unlock()
			}
		}()
	}
	select {}
}

const storedCallers = 8

// A process killed with SIGKILL while concurrent callers append rows and wait for Stored loses
// none that Stored returned for: a new writer on its spool delivers every acknowledged step and
// its reward, with Stored waiting for the write through the page cache (the server's default)
// or for the fsync of an O_DIRECT write (Config.Sync, as --ledger-sync runs it).
// The kill comes right after an acknowledgement, when the last ones are the newest rows.
func TestSIGKILLKeepsStoredRows(t *testing.T) {
	t.Parallel()
	url := pgtest.Start(t)
	for _, mode := range []string{"write", "sync"} {
		t.Run(mode, func(t *testing.T) {
			ep := "stored-" + mode
			spool := t.TempDir()
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), childEnv+"="+spool, childURLEnv+"="+url, childEpisodeEnv+"="+ep, childStoredEnv+"="+mode)
			cmd.Stderr = os.Stderr
			out, err := cmd.StdoutPipe()
			must(t, err)
			must(t, cmd.Start())
			acked := map[string]int{} // episode → highest index acknowledged
			n := 0
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				f := strings.Fields(sc.Text())
				if len(f) != 3 || f[0] != "stored" {
					continue
				}
				i, _ := strconv.Atoi(f[2])
				acked[f[1]] = max(acked[f[1]], i)
				if n++; n == 3000 {
					must(t, cmd.Process.Kill())
				}
			}
			_ = cmd.Wait()
			if n < 3000 {
				t.Fatalf("the child stopped after %d acknowledgements, before the kill", n)
			}
			w, err := ledger.NewWriter(ledger.Config{URL: url, SpoolDir: spool, Logger: quiet})
			must(t, err)
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			must(t, w.Close(ctx))
			for e, top := range acked {
				steps := count(t, url, "SELECT count(*) FROM steps WHERE episode_id = $1 AND idx <= $2", e, top)
				rewards := count(t, url, "SELECT count(*) FROM rewards WHERE episode_id = $1 AND step_index <= $2", e, top)
				if steps != top+1 || rewards != top+1 {
					t.Fatalf("episode %s: steps 0 to %d acknowledged, %d steps and %d rewards of them delivered", e, top, steps, rewards)
				}
				digests := count(t, url, "SELECT count(*) FROM checkpoint_digests WHERE split_part(id, '/c', 1) = $1 AND split_part(id, '/c', 2)::int <= $2", e, top)
				edges := count(t, url, "SELECT count(*) FROM checkpoint_edges WHERE split_part(child_id, '/c', 1) = $1 AND split_part(child_id, '/c', 2)::int <= $2", e, top)
				if digests != top+1 || edges != top {
					t.Fatalf("episode %s: steps 0 to %d acknowledged, %d digests and %d edges of their checkpoints delivered", e, top, digests, edges)
				}
			}
			t.Logf("killed after %d acknowledged steps of %d callers: all delivered", n, len(acked))
		})
	}
}
