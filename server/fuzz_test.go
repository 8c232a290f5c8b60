package server

import (
	"errors"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/envpool"
)

// fuzzRequests are the request messages a client sends: the fuzzer's which byte picks one.
var fuzzRequests = []func() proto.Message{
	func() proto.Message { return &deltagymv1.StepRequest{} },
	func() proto.Message { return &deltagymv1.StepStreamRequest{} },
	func() proto.Message { return &deltagymv1.ResetRequest{} },
	func() proto.Message { return &deltagymv1.ForkRequest{} },
	func() proto.Message { return &deltagymv1.CheckpointRequest{} },
	func() proto.Message { return &deltagymv1.RestoreRequest{} },
	func() proto.Message { return &deltagymv1.RegisterEnvRequest{} },
	func() proto.Message { return &deltagymv1.ImportImageRequest{} },
	func() proto.Message { return &deltagymv1.ListSandboxesRequest{} },
	func() proto.Message { return &deltagymv1.GetTrajectoryRequest{} },
	func() proto.Message { return &deltagymv1.ReportRewardRequest{} },
	func() proto.Message { return &deltagymv1.HeartbeatRequest{} },
}

// FuzzRequestDecode decodes untrusted bytes into a request message, as the server's JSON codec
// and protobuf's binary decoding do, and takes what decoded down the request's path to the
// episode core (the wire-to-domain conversions, the env spec's validation). Nothing may panic,
// and what decoded must survive a round trip through the codec unchanged.
func FuzzRequestDecode(f *testing.F) {
	codec := jsonCodec{"json"}
	f.Fuzz(func(t *testing.T, data []byte, which uint8) {
		newMsg := fuzzRequests[int(which)%len(fuzzRequests)]
		m := newMsg()
		if err := codec.Unmarshal(data, m); err == nil {
			toDomain(m)
			out, err := codec.Marshal(m)
			if err != nil {
				t.Fatalf("marshalling what decoded: %v", err)
			}
			again := newMsg()
			if err := codec.Unmarshal(out, again); err != nil {
				t.Fatalf("decoding %s again: %v", out, err)
			}
			if !sameMessage(m, again) {
				t.Fatalf("the round trip changed the message:\n%v\n%v", m, again)
			}
		}
		m = newMsg()
		if proto.Unmarshal(data, m) == nil {
			toDomain(m)
			if _, err := codec.Marshal(m); err != nil && !strings.Contains(err.Error(), "invalid UTF-8") {
				t.Fatalf("marshalling a binary request as JSON: %v", err)
			}
		}
	})
}

// toDomain runs the conversions and checks a handler runs on m before the episode core.
func toDomain(m proto.Message) {
	switch r := m.(type) {
	case *deltagymv1.StepRequest:
		_ = stepRequest(r)
	case *deltagymv1.StepStreamRequest:
		_ = stepRequest(r.GetStep())
	case *deltagymv1.ResetRequest:
		_ = resetRequest(r)
	case *deltagymv1.ForkRequest:
		_ = forkRequest(r)
	case *deltagymv1.CheckpointRequest:
		_, _ = processMode(r.GetProcessMode())
	case *deltagymv1.RegisterEnvRequest:
		_ = envpool.ValidateSpec(r.GetSpec())
	}
}

// sameMessage compares two messages by their deterministic encoding (proto.Equal takes two
// NaNs for different).
func sameMessage(a, b proto.Message) bool {
	opts := proto.MarshalOptions{Deterministic: true}
	x, err1 := opts.Marshal(a)
	y, err2 := opts.Marshal(b)
	return err1 == nil && err2 == nil && string(x) == string(y)
}

// FuzzImportRoot resolves request paths below an import root laid out with the ways out an
// attacker would plant: symlinks to the host's root, up the tree, to an absolute path inside,
// through /proc's magic links, and a directory beside the root. A path either resolves to
// something below the root or is refused with ErrInvalid; rel never answers a path that climbs.
func FuzzImportRoot(f *testing.F) {
	parent := f.TempDir()
	dir := filepath.Join(parent, "imports")
	outside := filepath.Join(parent, "outside")
	for _, d := range []string{filepath.Join(dir, "img", "rootfs", "etc"), outside} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			f.Fatal(err)
		}
	}
	for name, target := range map[string]string{
		"root": "/", "up": "../..", "beside": "../outside", "abs-in": filepath.Join(dir, "img"),
		"magic": "/proc/self/root", "fd": "/proc/self/fd", "loop": "loop", "img/rootfs/etc/up": "../../../..",
	} {
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			f.Fatal(err)
		}
	}
	for _, p := range []string{filepath.Join(outside, "secret"), filepath.Join(dir, "img", "rootfs", "etc", "hostname")} {
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			f.Fatal(err)
		}
	}
	r, err := openImportRoot(dir, 1<<20)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { r.Close() })
	f.Fuzz(func(t *testing.T, name string) {
		name = strings.ReplaceAll(name, "@ROOT@", dir)
		name = strings.ReplaceAll(name, "@OUTSIDE@", outside)
		if rel, err := r.rel("image path", name); err == nil && (filepath.IsAbs(rel) || rel == ".." || strings.HasPrefix(rel, "../")) {
			t.Fatalf("rel(%q) = %q: leaves the root", name, rel)
		}
		file, err := r.open(name)
		if err != nil {
			if !errors.Is(err, ErrInvalid) && !errors.Is(err, os.ErrPermission) && !strings.Contains(err.Error(), "name too long") {
				t.Fatalf("open(%q): %v, want ErrInvalid", name, err)
			}
			return
		}
		defer file.Close()
		got, err := os.Readlink(fdPath(file))
		if err != nil {
			t.Fatal(err)
		}
		if got != dir && !strings.HasPrefix(got, dir+"/") {
			t.Fatalf("open(%q) resolved to %s, outside the root %s", name, got, dir)
		}
	})
}

// FuzzParseBytes parses sizes as the flags take them (--import-max-bytes): a size that parses
// is exactly the number times its unit, never one that wrapped around.
func FuzzParseBytes(f *testing.F) {
	f.Fuzz(func(t *testing.T, v string) {
		n, err := parseBytes(v)
		if err != nil {
			return
		}
		num := strings.TrimSpace(strings.TrimRight(v, "KkMmGgTtIiBb"))
		want, ok := new(big.Int).SetString(num, 10)
		if !ok {
			t.Fatalf("parseBytes(%q) = %d: the number %q does not parse", v, n, num)
		}
		unit := strings.ToLower(strings.TrimSpace(v[len(strings.TrimRight(v, "KkMmGgTtIiBb")):]))
		shift := map[string]uint{"": 0, "b": 0, "k": 10, "kb": 10, "kib": 10, "m": 20, "mb": 20, "mib": 20,
			"g": 30, "gb": 30, "gib": 30, "t": 40, "tb": 40, "tib": 40}[unit]
		want.Lsh(want, shift)
		if want.Cmp(big.NewInt(n)) != 0 {
			t.Fatalf("parseBytes(%q) = %d, want %s", v, n, want)
		}
	})
}
