package server

import (
	"encoding/binary"
	"fmt"
	"io"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	"github.com/deltagym/deltagym/sandbox"
)

// The request cap and the file cap agree: the default cap (RequestCapFor(sandbox.MaxFileBytes))
// carries a write_file of the largest file a sandbox takes in every encoding the server speaks.
// Connect JSON is the largest, bytes fields being base64 (4 bytes for 3); requestSlack covers
// the rest of a request (field names, the path, an envelope's prefix).

// requestSlack is what a request holds besides a file's content, at most.
const requestSlack = 1 << 20

// RequestCapFor returns the smallest request cap (Config.MaxRequestBytes) that carries a
// write_file of fileBytes bytes as Connect JSON, and so in every other encoding.
func RequestCapFor(fileBytes int) int { return (fileBytes+2)/3*4 + requestSlack }

// ResponseCap is the largest response message a server with request cap requestCap sends:
// the request cap, or what carries a read of the largest file a sandbox holds (a download, a
// read_file) as Connect JSON if that is more. The largest answers the API gives (a file read,
// a diff within its budgets) fit; a message past it fails with ResourceExhausted instead of
// being built and sent whatever its size.
func ResponseCap(requestCap int) int { return max(requestCap, RequestCapFor(sandbox.MaxFileBytes)) }

// capBodies refuses a request message over limit bytes with ResourceExhausted and a message
// that names the request cap and the file cap and says what to do. It counts each message as
// it is read: an enveloped one (gRPC, gRPC-Web, Connect streams) by the size in its prefix,
// before its content is read; a Connect unary one (the whole body) as its bytes arrive. Connect's
// own limit (connect.WithReadMaxBytes) stays, at the same size, for decompressed messages.
func capBodies(next http.Handler, limit int) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body != nil && r.Body != http.NoBody {
			ct := r.Header.Get("Content-Type")
			enveloped := strings.HasPrefix(ct, "application/grpc") || strings.HasPrefix(ct, "application/connect+")
			r.Body = &cappedBody{ReadCloser: r.Body, limit: int64(limit), enveloped: enveloped}
		}
		next.ServeHTTP(w, r)
	})
}

// cappedBody is a request body that fails a read once a message goes past limit
// (capBodies). An enveloped body is a series of messages, each a 5-byte prefix (flags and a
// big-endian size) and its content; left counts down the current one's.
type cappedBody struct {
	io.ReadCloser
	limit     int64
	enveloped bool
	read      int64   // a unary body's bytes so far
	prefix    [5]byte // an envelope prefix being read
	have      int     // its bytes so far
	left      int64   // the current envelope's content bytes still to come
}

// Read implements io.Reader.
func (b *cappedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if !b.enveloped {
		b.read += int64(n)
		if b.read > b.limit {
			return n, requestTooLarge(fmt.Sprintf("more than %d bytes", b.limit), b.limit)
		}
		return n, err
	}
	for q := p[:n]; len(q) > 0; {
		if b.left > 0 {
			k := min(int64(len(q)), b.left)
			b.left -= k
			q = q[k:]
			continue
		}
		k := copy(b.prefix[b.have:], q)
		b.have += k
		q = q[k:]
		if b.have < len(b.prefix) {
			break
		}
		b.have = 0
		b.left = int64(binary.BigEndian.Uint32(b.prefix[1:]))
		if b.left > b.limit {
			// The prefix's last byte is kept back: a reader that asked for the prefix
			// alone (io.ReadFull) drops an error that comes with all it asked for.
			return n - len(q) - 1, requestTooLarge(fmt.Sprintf("%d bytes", b.left), b.limit)
		}
	}
	return n, err
}

// requestTooLarge is the error of a request message of size (in words) over the cap limit.
func requestTooLarge(size string, limit int64) error {
	return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf(
		"request message of %s exceeds the server's request cap of %d bytes (--max-request-bytes); a sandbox's files may be up to %d bytes, "+
			"which a cap of %d bytes carries in every encoding (Connect JSON base64-encodes them); send a large file in parts "+
			"(write_file with append), or raise --max-request-bytes", size, limit, sandbox.MaxFileBytes, RequestCapFor(sandbox.MaxFileBytes)))
}
