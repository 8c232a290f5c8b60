package clustertest

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"golang.org/x/net/dns/dnsmessage"
)

// dnsServer is the cluster's DNS, as a Kubernetes headless Service's is: it answers the A
// queries for one name with the addresses the test sets (AAAA: none; other names: NXDOMAIN),
// on UDP and TCP port 53 of an address of the bridge's namespace.
type dnsServer struct {
	name string // fully qualified, lowercase
	addr string // host:53
	udp  net.PacketConn
	tcp  net.Listener
	wg   sync.WaitGroup

	mu sync.Mutex
	// +checklocks:mu
	ips []netip.Addr
	// +checklocks:mu
	conns map[net.Conn]struct{}
}

// startDNS serves name with ips at ip:53 inside ns until the test ends.
func startDNS(t testing.TB, ns *netns, ip, name string, ips ...string) *dnsServer {
	t.Helper()
	d := &dnsServer{name: strings.ToLower(strings.TrimSuffix(name, ".")) + ".", addr: net.JoinHostPort(ip, "53"), conns: map[net.Conn]struct{}{}}
	d.set(t, ips...)
	var err error
	if d.udp, err = inNetns(ns, func() (net.PacketConn, error) { return net.ListenPacket("udp", d.addr) }); err != nil {
		t.Fatal(err)
	}
	if d.tcp, err = inNetns(ns, func() (net.Listener, error) { return net.Listen("tcp", d.addr) }); err != nil {
		d.udp.Close()
		t.Fatal(err)
	}
	d.wg.Go(d.serveUDP)
	d.wg.Go(d.serveTCP)
	t.Cleanup(d.close)
	return d
}

// close stops serving and waits for every goroutine of d.
func (d *dnsServer) close() {
	d.udp.Close()
	d.tcp.Close()
	d.mu.Lock()
	for c := range d.conns {
		c.Close()
	}
	d.mu.Unlock()
	d.wg.Wait()
}

// set makes the name resolve to ips.
func (d *dnsServer) set(t testing.TB, ips ...string) {
	t.Helper()
	addrs := make([]netip.Addr, len(ips))
	for i, s := range ips {
		a, err := netip.ParseAddr(s)
		if err != nil || !a.Is4() {
			t.Fatalf("DNS record %q: want an IPv4 address", s)
		}
		addrs[i] = a
	}
	d.mu.Lock()
	d.ips = addrs
	d.mu.Unlock()
}

func (d *dnsServer) serveUDP() {
	buf := make([]byte, 1500)
	for {
		n, from, err := d.udp.ReadFrom(buf)
		if err != nil {
			return // closed
		}
		if resp, err := d.answer(buf[:n]); err == nil {
			_, _ = d.udp.WriteTo(resp, from)
		}
	}
}

func (d *dnsServer) serveTCP() {
	for {
		c, err := d.tcp.Accept()
		if err != nil {
			return // closed
		}
		d.mu.Lock()
		d.conns[c] = struct{}{}
		d.mu.Unlock()
		d.wg.Go(func() {
			defer func() {
				d.mu.Lock()
				delete(d.conns, c)
				d.mu.Unlock()
				c.Close()
			}()
			_ = d.serveConn(c)
		})
	}
}

// serveConn answers the queries of one TCP connection, each framed by its 2-byte length.
func (d *dnsServer) serveConn(c net.Conn) error {
	var n [2]byte
	for {
		if _, err := io.ReadFull(c, n[:]); err != nil {
			return err
		}
		q := make([]byte, binary.BigEndian.Uint16(n[:]))
		if _, err := io.ReadFull(c, q); err != nil {
			return err
		}
		resp, err := d.answer(q)
		if err != nil {
			return err
		}
		if len(resp) > 0xffff {
			return errors.New("answer too long")
		}
		out := binary.BigEndian.AppendUint16(nil, uint16(len(resp)))
		if _, err := c.Write(append(out, resp...)); err != nil {
			return err
		}
	}
}

func (d *dnsServer) answer(query []byte) ([]byte, error) {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil {
		return nil, err
	}
	q, err := p.Question()
	if err != nil {
		return nil, err
	}
	ours := strings.EqualFold(q.Name.String(), d.name)
	rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired}
	if !ours {
		rh.RCode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(nil, rh)
	b.EnableCompression()
	if err := b.StartQuestions(); err != nil {
		return nil, err
	}
	if err := b.Question(q); err != nil {
		return nil, err
	}
	if err := b.StartAnswers(); err != nil {
		return nil, err
	}
	if ours && q.Type == dnsmessage.TypeA {
		d.mu.Lock()
		ips := d.ips
		d.mu.Unlock()
		for _, ip := range ips {
			if err := b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 1}, dnsmessage.AResource{A: ip.As4()}); err != nil {
				return nil, err
			}
		}
	}
	return b.Finish()
}
