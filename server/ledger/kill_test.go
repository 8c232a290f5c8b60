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
	"sync/atomic"
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

// killWindow is the child writer's group-commit window.
const killWindow = 10 * time.Millisecond

// killChild is the process the SIGKILL test kills: it appends a step and a reward per line it
// prints, each line written only after its appends returned. A line is "step appended synced
// taken unix-nanos max-sync late": the writer's counters, the last row the syncer's latest
// spool write may have taken, the time after the appends, the slowest write+fsync so far and
// how late a timer fired.
func killChild() int {
	w, err := ledger.NewWriter(ledger.Config{URL: os.Getenv(childURLEnv), SpoolDir: os.Getenv(childEnv), GroupCommit: killWindow, Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ep := os.Getenv(childEpisodeEnv)
	if err := w.EpisodeStarted(ledger.EpisodeStart{ID: ep, Env: "env"}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	// The syncer waits out each window on a timer, and a busy machine wakes it late, stretching
	// the window. This goroutine sleeps on short timers too; each line reports its worst
	// lateness since the line before, or how overdue its current sleep is if that is worse, so
	// a stall going on at the kill counts.
	var worst, sleepFrom atomic.Int64
	go func() {
		for {
			from := time.Now()
			sleepFrom.Store(from.UnixNano())
			time.Sleep(time.Millisecond)
			late := int64(time.Since(from) - time.Millisecond)
			for {
				cur := worst.Load()
				if late <= cur || worst.CompareAndSwap(cur, late) {
					break
				}
			}
		}
	}()
	// Only this goroutine appends, so the buffered bytes drop only when the syncer takes the
	// window: between two lines it took the rows up to the earlier line's, during a line's
	// appends at most up to that line's.
	taken, appended, buffered := uint64(0), w.Stats().Appended, w.Buffered()
	for i := 0; ; i++ {
		before := w.Buffered()
		step := i
		_ = w.Step(ledger.StepRow{EpisodeID: ep, Index: i, Action: json.RawMessage(`"a"`), Observation: []byte("obs")})
		_ = w.Reward(ledger.RewardRow{EpisodeID: ep, StepIndex: &step, Source: "verifier", Value: 1})
		// The clock is read between the appends and the counters: the rows were appended
		// before now, and whatever the counters do not show yet happened after it.
		now := time.Now().UnixNano()
		st := w.Stats()
		after := w.Buffered()
		switch {
		case before < buffered:
			taken = appended
		case after <= before:
			taken = st.Appended
		}
		appended, buffered = st.Appended, after
		late := max(worst.Swap(0), now-sleepFrom.Load()-int64(time.Millisecond))
		fmt.Fprintf(os.Stdout, "%d %d %d %d %d %d %d\n", i, st.Appended, st.Synced, taken, now, st.MaxSync, late)
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

// killReport is one line of the child's.
type killReport struct {
	appended, synced, taken uint64
	at                      int64 // unix nanos, after the line's appends
	maxSync, late           time.Duration
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
	var reps []killReport // one a step, in order
	killed := false
	seenSynced := -1
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 7 {
			continue
		}
		var n [7]int64
		for k := range f {
			n[k], _ = strconv.ParseInt(f[k], 10, 64)
		}
		r := killReport{appended: uint64(n[1]), synced: uint64(n[2]), taken: uint64(n[3]), at: n[4],
			maxSync: time.Duration(n[5]), late: time.Duration(n[6])}
		reps = append(reps, r)
		i := len(reps) - 1
		if seenSynced < 0 && r.synced >= 6000 {
			seenSynced = i
		}
		if !killed && seenSynced >= 0 && i >= seenSynced+after {
			killed = true
			must(t, cmd.Process.Kill())
		}
	}
	_ = cmd.Wait()
	if !killed {
		t.Fatal("child exited before it was killed")
	}
	lastStep := len(reps) - 1
	last := reps[lastStep]
	// Seq 1 is the episode start; step i is seq 2+2i, its reward 3+2i.
	durableSteps := int(last.synced-2)/2 + 1

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

	// From here on everything is on the child's clock and ends at its last report: what the
	// parent did after reading that report (its pipe lag, the kill) is not charged to the
	// writer. span: how long before that report the child appended the first row it lost.
	lost := lastStep + 1 - stored
	var span time.Duration
	if lost > 0 {
		span = time.Duration(last.at - reps[stored].at)
	}
	// The write+fsync that made the last durable rows finished between reports j-1 and j.
	j := lastStep
	for j > 0 && reps[j-1].synced == last.synced {
		j--
	}
	// A window the syncer took shows first in some report k, so its write+fsync began after
	// report k-1. The last one taken may not have been synced by the last report (it was in
	// flight); the one before it, or else the last, made the last durable rows, and it took no
	// longer than from report k-1 to report j+1, nor than the slowest write+fsync.
	var inFlight time.Duration
	lastSync := last.maxSync
	for k := lastStep; k > 0; k-- {
		if reps[k].taken == reps[k-1].taken {
			continue
		}
		if reps[k].taken > last.synced {
			inFlight = time.Duration(last.at - reps[k-1].at)
			continue
		}
		if j < lastStep {
			lastSync = min(lastSync, time.Duration(reps[j+1].at-reps[k-1].at))
		}
		break
	}
	// The timer that matters is the one the syncer set when that write+fsync finished.
	var late time.Duration
	for _, r := range reps[max(j-1, 0):] {
		late = max(late, r.late)
	}
	t.Logf("SIGKILL after %d acknowledged steps: %d durable at the last report, %d recovered, %d lost, appended in the last %v (window %v, last write+fsync %v, timer lateness %v, write+fsync in flight for %v; slowest write+fsync %v)",
		lastStep+1, durableSteps, stored, max(lost, 0), span, killWindow, lastSync, late, inFlight, last.maxSync)
	// A SIGKILL loses the rows of the windows whose spool write had not returned. With one
	// window per group commit, the oldest of them was appended after the syncer took the last
	// synced window: that write+fsync ran, then the next window's timer (late or not), and the
	// syncer may then have taken that window and been writing it at the kill. Rows older than
	// that mean more than one window lost.
	if limit := killWindow + lastSync + late + inFlight; span > limit {
		t.Fatalf("lost steps appended over %v before the child's last report: more than a group-commit window plus the write+fsync in flight (%v)", span, limit)
	}
}
