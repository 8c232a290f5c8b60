package server

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// The JSON codec refuses an enum name the schema lacks wherever it is in a known field, and
// otherwise reads what connect's codec reads: unknown fields ignored, names, numbers and proto
// field names taken.
func TestJSONCodecEnumNames(t *testing.T) {
	c := jsonCodec{"json"}
	for _, tc := range []struct {
		body string
		msg  proto.Message
		want proto.Message // nil: refused with an error containing bad
		bad  string
	}{
		{`{"sandboxId":"a","processMode":"PROCESS_MODE_CRIU"}`, &deltagymv1.CheckpointRequest{},
			&deltagymv1.CheckpointRequest{SandboxId: "a", ProcessMode: deltagymv1.ProcessMode_PROCESS_MODE_CRIU}, ""},
		{`{"sandbox_id":"a","processMode":2}`, &deltagymv1.CheckpointRequest{},
			&deltagymv1.CheckpointRequest{SandboxId: "a", ProcessMode: deltagymv1.ProcessMode_PROCESS_MODE_TEMPLATE}, ""},
		{`{"newer":{"processMode":"CRIU"},"sandboxId":"a"}`, &deltagymv1.CheckpointRequest{},
			&deltagymv1.CheckpointRequest{SandboxId: "a"}, ""},
		{`{"sandboxId":"a","processMode":"CRIU"}`, &deltagymv1.CheckpointRequest{}, nil,
			`processMode: "CRIU" is not a value of ProcessMode (PROCESS_MODE_UNSPECIFIED, PROCESS_MODE_FILESYSTEM, PROCESS_MODE_TEMPLATE, PROCESS_MODE_CRIU, or their numbers)`},
		{`{"newer":1,"processMode":"CRIU"}`, &deltagymv1.CheckpointRequest{}, nil, `processMode: "CRIU"`},
		{`{"processMode":"unknown field"}`, &deltagymv1.CheckpointRequest{}, nil, `processMode: "unknown field"`},
		{`{"spec":{"name":"a","newer":1,"image":"x","processMode":"CRIU"}}`, &deltagymv1.RegisterEnvRequest{}, nil, `spec.processMode: "CRIU"`},
		{`{"sandboxId":`, &deltagymv1.CheckpointRequest{}, nil, "unmarshal into"},
		{``, &deltagymv1.CheckpointRequest{}, nil, "zero-length payload"},
	} {
		err := c.Unmarshal([]byte(tc.body), tc.msg)
		switch {
		case tc.want != nil && err != nil:
			t.Errorf("%s: %v", tc.body, err)
		case tc.want != nil && !proto.Equal(tc.msg, tc.want):
			t.Errorf("%s: read %v, want %v", tc.body, tc.msg, tc.want)
		case tc.want == nil && (err == nil || !strings.Contains(err.Error(), tc.bad)):
			t.Errorf("%s: %v, want an error with %s", tc.body, err, tc.bad)
		}
	}
	// Marshalling is protojson's, as connect's is.
	m := &deltagymv1.CheckpointRequest{SandboxId: "a", ProcessMode: deltagymv1.ProcessMode_PROCESS_MODE_CRIU, Durable: true}
	got, err := c.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := protojson.Marshal(m)
	if string(got) != string(want) {
		t.Fatalf("marshal: %s, want %s", got, want)
	}
}
