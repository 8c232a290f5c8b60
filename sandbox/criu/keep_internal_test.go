package criu

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/rpc"
	"google.golang.org/protobuf/proto"
)

// A failed request's error gives the cause criu logged, not the harmless
// first error line every run here logs, and names a copy of the log that
// outlives the images directory; the copies are bounded.
func TestRequestErrorKeepsLog(t *testing.T) {
	dir := t.TempDir()
	images := filepath.Join(dir, "images")
	if err := os.Mkdir(images, 0o755); err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(images, "dump.log")
	body := "(00.000001) Version: 4.2.1\n" +
		"(00.000100) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n" +
		"(00.000200) Error (criu/files.c:99): pidfd: the process of pidfd 5 is not in the tree\n" +
		"(00.000300) Error (criu/cr-dump.c:1975): Dumping FAILED.\n"
	if err := os.WriteFile(log, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	keep := &logKeeper{dir: filepath.Join(dir, "kept"), max: 2}
	resp := &rpc.CriuResp{CrErrmsg: proto.String("rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted"), CrErrno: proto.Int32(0)}
	var kept string
	for range 3 {
		err := requestError(rpc.CriuReqType_DUMP, resp, log, keep)
		if !errors.Is(err, ErrRequest) {
			t.Fatalf("error %v is not ErrRequest", err)
		}
		msg := err.Error()
		if !strings.HasPrefix(msg, "criu DUMP: "+ErrRequest.Error()+": pidfd: the process of pidfd 5 is not in the tree; Dumping FAILED.") || strings.Contains(msg, "RLIMIT") {
			t.Fatalf("error %q: want the pidfd cause first, and no rlimit line", msg)
		}
		i := strings.Index(msg, "criu's log: ")
		if i < 0 {
			t.Fatalf("error %q names no log", msg)
		}
		kept = strings.TrimSuffix(msg[i+len("criu's log: "):], ")")
		if !strings.HasPrefix(kept, keep.dir+"/") {
			t.Fatalf("error names log %q, not a kept copy", kept)
		}
	}
	if err := os.RemoveAll(images); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(kept); err != nil || string(b) != body {
		t.Fatalf("kept log %s after the images went: %q, %v", kept, b, err)
	}
	if ents, err := os.ReadDir(keep.dir); err != nil || len(ents) != 2 {
		t.Fatalf("kept logs: %v, %v; want the newest 2", ents, err)
	}
	// Without a log, criu's own message is the cause.
	err := requestError(rpc.CriuReqType_RESTORE, &rpc.CriuResp{CrErrmsg: proto.String("no images")}, log, nil)
	if !strings.Contains(err.Error(), "criu RESTORE: "+ErrRequest.Error()+": no images (errno 0; criu's log: "+log+")") {
		t.Fatalf("error without a log: %v", err)
	}
}
