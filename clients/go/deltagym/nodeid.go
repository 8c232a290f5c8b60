package deltagym

import "strings"

// The shape of sandbox and checkpoint IDs, as the server makes them: PREFIX-NODE-HEX, as
// "sb-node-a-3f2a9c0d1e4b5a69", where PREFIX is "sb" or "ck", NODE the name of the node that
// holds it and HEX sixteen lowercase hex digits. A node name is 1 to maxNodeName bytes of
// lowercase letters, digits, '-' and '.', starting and ending with a letter or digit. An ID of
// any other shape ("sb-3f2a9c0d1e4b5a69", made by a node that had no name) names no node.
//
// NodeOf must agree with the server's reading of its own IDs (internal/nodeid.Node in the
// server's module, which this module does not import): a test there checks both on a table of
// IDs and by fuzzing.
const (
	maxNodeName = 100
	idHexLen    = 16
)

// NodeOf returns the name of the node a sandbox or checkpoint ID names, "" when it names none.
// A Cluster sends every call on an ID to that node.
func NodeOf(id string) string {
	p := strings.IndexByte(id, '-')
	q := len(id) - idHexLen - 1
	if p < 0 || q <= p+1 || id[q] != '-' || !lowerHex(id[q+1:]) {
		return ""
	}
	node := id[p+1 : q]
	if !nodeName(node) {
		return ""
	}
	return node
}

// nodeName reports whether s can name a node.
func nodeName(s string) bool {
	if s == "" || len(s) > maxNodeName {
		return false
	}
	for i := range len(s) {
		c := s[i]
		alnum := c >= 'a' && c <= 'z' || c >= '0' && c <= '9'
		if !alnum && (c != '-' && c != '.' || i == 0 || i == len(s)-1) {
			return false
		}
	}
	return true
}

func lowerHex(s string) bool {
	for i := range len(s) {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
