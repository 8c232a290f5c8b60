package egress

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// MaxEntries bounds an allow-list.
const MaxEntries = 256

// Entry is one allowed destination: a DNS name (lower case) or an IP address, and a port.
type Entry struct {
	// Host is the name, lower-cased, or the address's text when IP is valid.
	Host string
	// IP is the address when the entry names one.
	IP   netip.Addr
	Port uint16
}

// String returns the entry as host:port.
func (e Entry) String() string { return net.JoinHostPort(e.Host, strconv.Itoa(int(e.Port))) }

// Policy is an allow-list. The zero Policy allows nothing.
type Policy struct {
	entries []Entry
}

// ParsePolicy parses an allow-list of host:port entries; the error names the first bad one.
func ParsePolicy(allow []string) (Policy, error) {
	if len(allow) > MaxEntries {
		return Policy{}, fmt.Errorf("%w: %d entries, at most %d", ErrBadEntry, len(allow), MaxEntries)
	}
	p := Policy{entries: make([]Entry, 0, len(allow))}
	for i, s := range allow {
		e, err := ParseEntry(s)
		if err != nil {
			return Policy{}, fmt.Errorf("entry %d: %w", i, err)
		}
		p.entries = append(p.entries, e)
	}
	return p, nil
}

// Entries returns the policy's entries.
func (p Policy) Entries() []Entry { return append([]Entry(nil), p.entries...) }

// Empty reports whether the policy allows nothing.
func (p Policy) Empty() bool { return len(p.entries) == 0 }

// ParseEntry parses one host:port: host a DNS name or an IP address (IPv6 in brackets), port
// 1-65535.
func ParseEntry(s string) (Entry, error) {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return Entry{}, fmt.Errorf("%w: %q is not host:port", ErrBadEntry, s)
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 {
		return Entry{}, fmt.Errorf("%w: %q: port %q is not a number from 1 to 65535", ErrBadEntry, s, port)
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		if ip.Zone() != "" {
			return Entry{}, fmt.Errorf("%w: %q: an address with a zone", ErrBadEntry, s)
		}
		ip = ip.Unmap()
		return Entry{Host: ip.String(), IP: ip, Port: uint16(n)}, nil
	}
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	if !validName(host) {
		return Entry{}, fmt.Errorf("%w: %q: host %q is neither an IP address nor a DNS name", ErrBadEntry, s, host)
	}
	return Entry{Host: host, Port: uint16(n)}, nil
}

// validName reports whether s is a DNS name of letters, digits, '-' and '_' in dot-separated
// labels of 1-63 characters, at most 253 in all, not all digits.
func validName(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	digits := true
	for _, label := range strings.Split(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, c := range label {
			switch {
			case c >= 'a' && c <= 'z', c == '-', c == '_':
				digits = false
			case c >= '0' && c <= '9':
			default:
				return false
			}
		}
	}
	return !digits
}

// names reports whether the policy has an entry for host (a name or an address) and port.
func (p Policy) names(host string, port uint16) bool {
	ip, isIP := parseIP(host)
	for _, e := range p.entries {
		if e.Port != port {
			continue
		}
		if isIP && e.IP.IsValid() && e.IP == ip || !isIP && !e.IP.IsValid() && e.Host == host {
			return true
		}
	}
	return false
}

// listsAddr reports whether an entry names address ip (as an IP) with port.
func (p Policy) listsAddr(ip netip.Addr, port uint16) bool {
	for _, e := range p.entries {
		if e.Port == port && e.IP.IsValid() && e.IP == ip {
			return true
		}
	}
	return false
}

// parseIP parses an address without a zone, IPv4-mapped IPv6 addresses unmapped.
func parseIP(s string) (netip.Addr, bool) {
	ip, err := netip.ParseAddr(s)
	if err != nil || ip.Zone() != "" {
		return netip.Addr{}, false
	}
	return ip.Unmap(), true
}

// specialReason says why ip is refused unless listed ("" for a public unicast address).
func specialReason(ip netip.Addr, own func(netip.Addr) bool) string {
	switch {
	case ip.IsUnspecified():
		return "a unspecified address"
	case ip.IsLoopback():
		return "a loopback address"
	case ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast():
		return "a link-local address"
	case ip.IsMulticast() || ip.IsInterfaceLocalMulticast():
		return "a multicast address"
	case ip.IsPrivate() || sharedOrReserved(ip):
		return "a private address"
	case own != nil && own(ip):
		return "the server's own address"
	}
	return ""
}

// sharedOrReserved covers what IsPrivate leaves out: carrier-grade NAT (100.64.0.0/10), this
// network (0.0.0.0/8), IETF and documentation ranges, 198.18.0.0/15, 240.0.0.0/4 and broadcast;
// IPv6 site-local (fec0::/10) and the documentation range.
func sharedOrReserved(ip netip.Addr) bool {
	for _, p := range reserved {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

var reserved = func() []netip.Prefix {
	var ps []netip.Prefix
	for _, s := range []string{
		"0.0.0.0/8", "100.64.0.0/10", "192.0.0.0/24", "192.0.2.0/24", "198.18.0.0/15",
		"198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4", "fec0::/10", "2001:db8::/32",
		"64:ff9b:1::/48",
	} {
		ps = append(ps, netip.MustParsePrefix(s))
	}
	return ps
}()

// choose returns the first of addrs the policy lets port reach, or the reason none is: an
// address of a special kind (specialReason) passes only when an entry names it as an IP.
func (p Policy) choose(addrs []netip.Addr, port uint16, own func(netip.Addr) bool) (netip.Addr, string) {
	reason := "the name has no address"
	for _, a := range addrs {
		a = a.Unmap()
		r := specialReason(a, own)
		if r == "" || p.listsAddr(a, port) {
			return a, ""
		}
		reason = fmt.Sprintf("%s is %s, which the allow-list does not name", a, r)
	}
	return netip.Addr{}, reason
}
