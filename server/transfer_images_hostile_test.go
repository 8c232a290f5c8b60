package server_test

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"testing"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/internal/nodeid"
	"github.com/deltagym/deltagym/server"
)

// imagesTar is a stream of process images: a tar of files, each name UNIT/FILE, of n zero bytes.
func imagesTar(t *testing.T, n int64, names ...string) (stream []byte, digest string) {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, name := range names {
		must(t, tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o600, Size: n, Format: tar.FormatPAX}))
		_, err := tw.Write(make([]byte, n))
		must(t, err)
	}
	must(t, tw.Close())
	sum := sha256.Sum256(buf.Bytes())
	return buf.Bytes(), "sha256:" + hex.EncodeToString(sum[:])
}

// TestAdoptedImagesCountTheirBytes: the process images a peer sends count against the
// checkpoint bytes cap as what they hold on this node, whatever sizes the peer's unit records
// claim (here a negative one, which would free budget that other checkpoints then take).
func TestAdoptedImagesCountTheirBytes(t *testing.T) {
	const token = "cluster-token"
	const size = 600 << 10
	stream, digest := imagesTar(t, size, "0/pages-1.img")
	evil := startHostilePeer(t, &hostilePeer{name: "evil", images: stream, describe: func(id string) *deltagymv1.CheckpointManifest {
		return &deltagymv1.CheckpointManifest{CheckpointId: id, Image: "default", Processes: 1,
			ProcessUnits: []byte(`[{"dir":"0","procs":[{"ns_pid":1,"comm":"sh"}],"bytes":-1073741824}]`),
			ImagesDigest: digest, ImagesBytes: size}
	}})
	b := setup(t, func(c *server.Config) {
		c.Cluster.Node, c.AuthToken, c.NoLedger = "node-b", token, true
		c.Cluster.Peers = evil.addr
		c.Admission.CheckpointBytes = 1 << 30
	})
	// The fork's restore of images that are no CRIU images fails; the adoption before it stands.
	_, _ = b.connect.Fork(t.Context(), connect.NewRequest(&deltagymv1.ForkRequest{
		Source: &deltagymv1.ForkRequest_CheckpointId{CheckpointId: nodeid.New("ck", "evil")}, N: 1}))
	if evil.imaged.Load() != 1 {
		t.Fatalf("%d fetches of the process images, want 1", evil.imaged.Load())
	}
	if used := gauge(b.scrape(t), "deltagym_admission_used", `cap="checkpoint-bytes"[^}]*`); used < size {
		t.Fatalf("checkpoint bytes in use after adopting %d bytes of process images: %d", size, used)
	}
}
