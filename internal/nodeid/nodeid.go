// Package nodeid makes and reads the IDs of sandboxes and checkpoints. An ID carries the name of
// the node that holds it, so that a client of a cluster can send a call on it to that node
// without asking anyone: PREFIX-NODE-HEX, as "sb-node-a-3f2a9c0d1e4b5a69", where PREFIX is "sb"
// or "ck", NODE a node name (CheckName) and HEX sixteen lowercase hex digits. An ID of a node
// that had no name ("sb-3f2a9c0d1e4b5a69"), or of any other shape, names no node: it is the
// local node's.
package nodeid

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
)

// MaxName is the longest node name: an ID of it fits the API's 128 bytes with room to spare.
const MaxName = 100

// hexLen is the length of an ID's random part.
const hexLen = 16

// CheckName reports whether name can name a node: 1 to MaxName bytes of lowercase letters,
// digits, '-' and '.', starting and ending with a letter or digit (a Kubernetes node's name,
// a DNS name, lowercased).
func CheckName(name string) error {
	if name == "" || len(name) > MaxName {
		return fmt.Errorf("node name %q: want 1 to %d bytes", name, MaxName)
	}
	for i := range len(name) {
		c := name[i]
		alnum := c >= 'a' && c <= 'z' || c >= '0' && c <= '9'
		if !alnum && (c != '-' && c != '.' || i == 0 || i == len(name)-1) {
			return fmt.Errorf("node name %q: want lowercase letters, digits, '-' and '.', starting and ending with a letter or digit", name)
		}
	}
	return nil
}

// FromHostname makes a node name of a host name: lowercased, every other byte made '-', cut to
// MaxName, with what CheckName refuses at its ends trimmed; "node" if nothing is left.
func FromHostname(host string) string {
	b := []byte(strings.ToLower(host))
	for i, c := range b {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '.' {
			b[i] = '-'
		}
	}
	if len(b) > MaxName {
		b = b[:MaxName]
	}
	s := strings.Trim(string(b), "-.")
	if s == "" {
		return "node"
	}
	return s
}

// New returns a new ID of prefix ("sb", "ck") on node; with node "", an ID of no node.
func New(prefix, node string) string {
	var b [hexLen / 2]byte
	_, _ = rand.Read(b[:])
	if node == "" {
		return prefix + "-" + hex.EncodeToString(b[:])
	}
	return prefix + "-" + node + "-" + hex.EncodeToString(b[:])
}

// Node returns the name of the node id names; "" when it names none.
func Node(id string) string {
	p := strings.IndexByte(id, '-')
	q := len(id) - hexLen - 1
	if p < 0 || q <= p+1 || id[q] != '-' || !isHex(id[q+1:]) {
		return ""
	}
	node := id[p+1 : q]
	if CheckName(node) != nil {
		return ""
	}
	return node
}

func isHex(s string) bool {
	for i := range len(s) {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
