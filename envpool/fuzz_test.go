package envpool_test

import (
	"errors"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/deltagym/deltagym/envpool"
)

// FuzzSpecRoundTrip parses untrusted env specs (envs/*.json, RegisterEnv's JSON): nothing panics, a
// refusal is ErrInvalidSpec, and a spec that parses is valid and parses again, unchanged, from
// its own JSON (FuzzParseSpec, beside the spec tests, checks the first two).
func FuzzSpecRoundTrip(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		spec, err := envpool.ParseSpec(data)
		if err != nil {
			if !errors.Is(err, envpool.ErrInvalidSpec) {
				t.Fatalf("ParseSpec: %v, want ErrInvalidSpec", err)
			}
			return
		}
		if err := envpool.ValidateSpec(spec); err != nil {
			t.Fatalf("a parsed spec is invalid: %v", err)
		}
		out, err := protojson.Marshal(spec)
		if err != nil {
			t.Fatal(err)
		}
		again, err := envpool.ParseSpec(out)
		if err != nil {
			t.Fatalf("parsing %s again: %v", out, err)
		}
		opts := proto.MarshalOptions{Deterministic: true}
		a, _ := opts.Marshal(spec)
		b, _ := opts.Marshal(again)
		if string(a) != string(b) {
			t.Fatalf("the round trip changed the spec:\n%v\n%v", spec, again)
		}
	})
}
