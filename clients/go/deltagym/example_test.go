package deltagym_test

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"connectrpc.com/connect"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
)

// The examples run against the in-process server that TestMain starts; Dial("")
// finds it through $DELTAGYM_ADDR, as it finds `make run`'s server at
// 127.0.0.1:8080 when the variable is unset.

func Example() {
	ctx := context.Background()
	c, err := deltagym.Dial("")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()

	sb, err := c.Reset(ctx, "shell")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sb.Close(ctx)

	res, err := sb.Exec(ctx, "echo hello from $(uname -s)")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("exit %d: %s", res.ExitCode, res.Stdout)
	// Output: exit 0: hello from Linux
}

func ExampleClient_Reset() {
	ctx := context.Background()
	c, err := deltagym.Dial("")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()

	// The seed and options reach the env's reset hook, which prints the task.
	sb, err := c.Reset(ctx, "shell", deltagym.WithSeed(7), deltagym.WithTaskOption("QUESTION", "6*7"),
		deltagym.WithRun("example"), deltagym.WithGroup("g1"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sb.Close(ctx)
	fmt.Print(string(sb.ResetResponse().GetObservation().GetReset_().GetHook().GetStdout()))
	// Output: task seed=7 question=6*7
}

func ExampleSandbox_Restore() {
	ctx := context.Background()
	c, err := deltagym.Dial("")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()
	sb, err := c.Reset(ctx, "shell")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sb.Close(ctx)

	if _, err := sb.WriteFile(ctx, "notes.txt", []byte("first draft\n")); err != nil {
		fmt.Println(err)
		return
	}
	ckpt, err := sb.Checkpoint(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := sb.Exec(ctx, "echo overwritten > notes.txt && rm -rf /work/*"); err != nil {
		fmt.Println(err)
		return
	}
	// Restore starts a new episode at the checkpoint: the file is back.
	episode := sb.EpisodeID()
	if _, err := sb.Restore(ctx, ckpt.ID); err != nil {
		fmt.Println(err)
		return
	}
	got, err := sb.ReadFile(ctx, "notes.txt")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%snew episode: %v\n", got.Content, sb.EpisodeID() != episode)
	// Output:
	// first draft
	// new episode: true
}

func ExampleSandbox_Fork() {
	ctx := context.Background()
	c, err := deltagym.Dial("")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()
	sb, err := c.Reset(ctx, "shell", deltagym.WithRun("example-grpo"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sb.Close(ctx)

	// A GRPO group: four rollouts from the same state, each answering
	// differently; the verifier rewards the answer 42.
	group := "group-" + deltagym.NewIdempotencyKey()[:8]
	fork, err := sb.Fork(ctx, 4, deltagym.WithGroup(group))
	if err != nil {
		fmt.Println(err)
		return
	}
	for i, child := range fork.Sandboxes {
		answer := []string{"42", "41", "42", "0"}[i]
		if _, err := child.WriteFile(ctx, "/work/answer.txt", []byte(answer)); err != nil {
			fmt.Println(err)
			return
		}
		res, err := child.Submit(ctx)
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("answer %-2s reward %g terminated %v\n", answer, res.Reward, res.Terminated)
		if err := child.Close(ctx); err != nil {
			fmt.Println(err)
			return
		}
	}
	adv, err := c.GroupAdvantages(ctx, group, "")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("counted %d, mean %.2f\n", adv.GetCountedCount(), adv.GetMean())
	// Output:
	// answer 42 reward 1 terminated true
	// answer 41 reward 0 terminated true
	// answer 42 reward 1 terminated true
	// answer 0  reward 0 terminated true
	// counted 4, mean 0.50
}

func ExampleSandbox_Evaluate() {
	ctx := context.Background()
	c, err := deltagym.Dial("")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()
	sb, err := c.Reset(ctx, "shell")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sb.Close(ctx)

	if _, err := sb.Exec(ctx, "echo 42 > /work/answer.txt"); err != nil {
		fmt.Println(err)
		return
	}
	// Evaluate runs the verifier without ending the episode.
	ev, err := sb.Evaluate(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	res, err := sb.Exec(ctx, "cat /work/answer.txt")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("reward %g %v, still running: %s", ev.Reward, ev.Components, res.Stdout)
	// Output: reward 1 map[correct:1], still running: 42
}

func ExampleClient_StepStream() {
	ctx := context.Background()
	c, err := deltagym.Dial("")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()
	sb, err := c.Reset(ctx, "shell")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sb.Close(ctx)

	stream, err := c.StepStream(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stream.Close()
	// Steps on one sandbox run in the order sent; a failing step (here on an
	// unknown sandbox) is answered with its error and the stream goes on.
	for _, cmd := range []string{"echo one > f", "echo two >> f", "cat f"} {
		if _, err := stream.Send(sb.ID(), deltagym.ExecAction(cmd), false); err != nil {
			fmt.Println(err)
			return
		}
	}
	if _, err := stream.Send("no-such-sandbox", deltagym.ExecAction("true"), false); err != nil {
		fmt.Println(err)
		return
	}
	if err := stream.CloseSend(); err != nil {
		fmt.Println(err)
		return
	}
	var lines []string
	for range 4 {
		r, err := stream.Receive()
		if err != nil {
			fmt.Println(err)
			return
		}
		if r.Err != nil {
			lines = append(lines, fmt.Sprintf("%d: %v", r.RequestID, connect.CodeOf(r.Err)))
			continue
		}
		e := r.Response.GetObservation().GetExec()
		lines = append(lines, fmt.Sprintf("%d: exit %d %q", r.RequestID, e.GetExitCode(), e.GetStdout()))
	}
	slices.Sort(lines)
	fmt.Println(strings.Join(lines, "\n"))
	// Output:
	// 1: exit 0 ""
	// 2: exit 0 ""
	// 3: exit 0 "one\ntwo\n"
	// 4: not_found
}

func ExampleDialCluster() {
	ctx := context.Background()
	// A cluster is named by "dns:NAME:PORT" (every address of NAME a node, as a Kubernetes
	// headless Service lists its pods) or by a comma-separated list of addresses; "" means
	// $DELTAGYM_ADDR, here one server: a cluster of one node.
	cl, err := deltagym.DialCluster(ctx, "")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cl.Close()

	sb, err := cl.Reset(ctx, "shell") // on the least loaded node
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sb.Close(ctx)

	// A handle of a sandbox known by its ID alone goes to the node the ID names.
	again, err := cl.Sandbox(sb.ID())
	if err != nil {
		fmt.Println(err)
		return
	}
	res, err := again.Exec(ctx, "echo routed")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%d node, on it: %v; %s", len(cl.Nodes()), cl.Nodes()[0].Name == deltagym.NodeOf(sb.ID()), res.Stdout)
	// Output: 1 node, on it: true; routed
}
