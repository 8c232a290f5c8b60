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
	"testing"
	"time"

	"github.com/deltagym/deltagym/server/ledger"
	"github.com/deltagym/deltagym/server/ledger/pgtest"
)

const (
	childEnv        = "DELTAGYM_LEDGER_KILL_SPOOL"
	childURLEnv     = "DELTAGYM_LEDGER_KILL_URL"
	childEpisodeEnv = "DELTAGYM_LEDGER_KILL_EPISODE"
)

// killChild is the process the SIGKILL test kills: it appends a step and a reward per line it
// prints ("step synced-seq unix-nanos"), each line written only after its appends returned.
func killChild() int {
	w, err := ledger.NewWriter(ledger.Config{URL: os.Getenv(childURLEnv), SpoolDir: os.Getenv(childEnv), Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ep := os.Getenv(childEpisodeEnv)
	if err := w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env"}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for i := 0; ; i++ {
		step := i
		_ = w.Step(ledger.StepRow{EpisodeID: ep, Index: i, Action: json.RawMessage(`"a"`), Observation: []byte("obs")})
		_ = w.Reward(ledger.RewardRow{EpisodeID: ep, StepIndex: &step, Source: "verifier", Value: 1})
		st := w.Stats()
		fmt.Fprintf(os.Stdout, "%d %d %d %d\n", i, st.Synced, time.Now().UnixNano(), st.MaxSync)
		if i%20 == 19 {
			time.Sleep(200 * time.Microsecond) // pace: ~50,000 rows/s
		}
	}
}

// TestSIGKILLLosesAtMostOneWindow kills a process writing to the spool (and delivering to
// Postgres) and checks that a new writer on its spool delivers every row that was durable, each
// exactly once, and that the rows lost were appended within the last group-commit window.
func TestSIGKILLLosesAtMostOneWindow(t *testing.T) {
	t.Parallel()
	url := pgtest.Start(t)
	// Kill at a few different points relative to the group commit.
	for round, after := range []int{0, 97, 331} {
		t.Run(fmt.Sprintf("round%d", round), func(t *testing.T) {
			killOnce(t, url, fmt.Sprintf("k%d", round), after)
		})
	}
}

func killOnce(t *testing.T, url, episode string, after int) {
	spool := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+spool, childURLEnv+"="+url, childEpisodeEnv+"="+episode)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	must(t, err)
	must(t, cmd.Start())
	sc := bufio.NewScanner(out)
	appended := map[int]int64{}
	lastStep, maxSynced := -1, uint64(0)
	var killedAt int64
	seenSynced := -1
	var maxSync time.Duration
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 4 {
			continue
		}
		i, _ := strconv.Atoi(f[0])
		synced, _ := strconv.ParseUint(f[1], 10, 64)
		ns, _ := strconv.ParseInt(f[2], 10, 64)
		ms, _ := strconv.ParseInt(f[3], 10, 64)
		maxSync = time.Duration(ms)
		appended[i], lastStep, maxSynced = ns, i, max(maxSynced, synced)
		if seenSynced < 0 && maxSynced >= 6000 {
			seenSynced = i
		}
		if killedAt == 0 && seenSynced >= 0 && i >= seenSynced+after {
			killedAt = time.Now().UnixNano()
			must(t, cmd.Process.Kill())
		}
	}
	_ = cmd.Wait()
	if killedAt == 0 {
		t.Fatal("child exited before it was killed")
	}
	// Seq 1 is the episode start; step i is seq 2+2i, its reward 3+2i.
	durableSteps := int(maxSynced-2)/2 + 1

	w, err := ledger.NewWriter(ledger.Config{URL: url, SpoolDir: spool, Logger: quiet})
	must(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	must(t, w.Close(ctx))

	stored := count(t, url, "SELECT count(*) FROM steps WHERE episode_id = $1", episode)
	if top := count(t, url, "SELECT coalesce(max(idx), -1) FROM steps WHERE episode_id = $1", episode); top != stored-1 {
		t.Fatalf("steps have a gap: %d rows, top index %d", stored, top)
	}
	rewards := count(t, url, "SELECT count(*) FROM rewards WHERE episode_id = $1", episode)
	distinct := count(t, url, "SELECT count(DISTINCT step_index) FROM rewards WHERE episode_id = $1", episode)
	if rewards != distinct {
		t.Fatalf("rewards delivered twice: %d rows, %d distinct", rewards, distinct)
	}
	if rewards != stored && rewards != stored-1 {
		t.Fatalf("rewards %d do not match steps %d", rewards, stored)
	}
	if stored < durableSteps {
		t.Fatalf("lost durable rows: %d steps stored, %d were reported synced", stored, durableSteps)
	}
	if stored > lastStep+2 {
		t.Fatalf("%d steps stored but only %d were appended", stored, lastStep+2)
	}
	lost := lastStep + 1 - stored
	var span time.Duration
	if lost > 0 {
		span = time.Duration(killedAt - appended[stored])
	}
	t.Logf("SIGKILL after %d acknowledged steps: %d durable at the last report, %d recovered, %d lost, appended in the last %v before the kill (window 10ms, slowest write+fsync %v)",
		lastStep+1, durableSteps, stored, max(lost, 0), span, maxSync)
	// The bound: one window plus the write+fsync in flight, plus slack for the parent reading
	// the pipe and scheduling on a loaded machine.
	if limit := 10*time.Millisecond + maxSync + 50*time.Millisecond; span > limit {
		t.Fatalf("lost steps appended %v before the kill: more than a group-commit window plus fsync (%v)", span, limit)
	}
}
