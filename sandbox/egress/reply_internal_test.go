package egress

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
)

// A refusal's body names the destination and why, once, without the error's class.
func TestReplyBody(t *testing.T) {
	server, client := net.Pipe()
	defer client.Close()
	go func() {
		defer server.Close()
		reply(server, http.StatusForbidden, fmt.Sprintf("%s: %v", "203.0.113.7:80", fmt.Errorf("%w: not in the env's allow-list", ErrRefused)))
	}()
	b, err := io.ReadAll(client)
	if err != nil {
		t.Fatal(err)
	}
	_, body, _ := strings.Cut(string(b), "\r\n\r\n")
	if want := "egress: 203.0.113.7:80: egress refused: not in the env's allow-list\n"; body != want || !strings.HasPrefix(string(b), "HTTP/1.1 403 Forbidden\r\n") {
		t.Fatalf("reply %q, want 403 with body %q", b, want)
	}
}
