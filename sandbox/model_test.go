package sandbox_test

import (
	"bytes"
	"context"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// The model-based test drives a sandbox with thousands of random file
// operations under /w, interleaved with checkpoints, restores to random
// earlier checkpoints, forks and releases, and applies each operation to an
// in-memory model too. The whole tree under /w (types, modes, contents,
// symlink targets, hard-link groups, user xattrs) is read back and compared
// with the model after every restore and fork, and now and then in between.
//
// The model is POSIX, hard links included: a change through one name of a
// file sealed in a layer shows through its other names, in the live
// sandbox and in every later checkpoint (TestHardlinksKeptAcrossCheckpoints).
// One overlayfs behaviour shapes the generator rather than the model:
// directories are renamed only when the outcome does not depend on whether the kernel
// renames them or busybox mv copies them after EXDEV (redirect_dir=off):
// no sparse file (a copy fills it in), no xattr (busybox cp drops them),
// no hard link (cp finds links by st_ino, which overlayfs with xino=off
// does not report consistently for copied-up files).

const (
	// modelXA is the static xattr helper inside the model image: busybox
	// has no setfattr.
	modelXA = "/usr/local/bin/xa"
	// smallMax bounds small files; sparse files are far larger, so the
	// listing tells them apart by size.
	smallMax = 4 << 20
	probeLen = 4096
)

// probes are the block offsets where sparse files get data; the listing
// hashes these blocks of every file larger than smallMax.
var probes = []int64{0, 257 * probeLen, 32<<20 + 3*probeLen, 200 << 20, 1<<30 - probeLen}

type minode struct {
	mode   uint32
	data   []byte // small files; never changed in place (snapshots share it)
	sparse bool
	size   int64            // sparse files
	blocks map[int64][]byte // sparse files: probe offset -> block bytes
	xattrs map[string]string
}

func newFile(mode uint32, data []byte) *minode {
	return &minode{mode: mode, data: data, xattrs: map[string]string{}}
}

func (in *minode) clone() *minode {
	c := *in
	c.blocks = map[int64][]byte{}
	for k, v := range in.blocks {
		c.blocks[k] = v
	}
	c.xattrs = map[string]string{}
	for k, v := range in.xattrs {
		c.xattrs[k] = v
	}
	return &c
}

func (in *minode) fileSize() int64 {
	if in.sparse {
		return in.size
	}
	return int64(len(in.data))
}

// digest is what the listing prints for the file: md5 of a small file, or
// md5 of the probe blocks of a sparse one.
func (in *minode) digest() string {
	h := md5.New()
	if !in.sparse {
		h.Write(in.data)
		return hex.EncodeToString(h.Sum(nil))
	}
	for _, p := range probes {
		if p >= in.size {
			continue
		}
		blk := make([]byte, min(probeLen, in.size-p))
		copy(blk, in.blocks[p])
		h.Write(blk)
	}
	return hex.EncodeToString(h.Sum(nil))
}

type mnode struct {
	kind   byte // 'd', 'f' or 'l'
	mode   uint32
	target string
	ino    *minode
}

type model struct {
	nodes map[string]*mnode // absolute paths under /w, /w included
}

func newModel() *model {
	return &model{nodes: map[string]*mnode{"/w": {kind: 'd', mode: 0o755}}}
}

// clone copies the model, keeping hard links shared.
func (m *model) clone() *model {
	c := &model{nodes: make(map[string]*mnode, len(m.nodes))}
	inos := map[*minode]*minode{}
	for p, n := range m.nodes {
		nn := *n
		if n.ino != nil {
			if inos[n.ino] == nil {
				inos[n.ino] = n.ino.clone()
			}
			nn.ino = inos[n.ino]
		}
		c.nodes[p] = &nn
	}
	return c
}

func (m *model) sorted(keep func(string, *mnode) bool) []string {
	var out []string
	for p, n := range m.nodes {
		if keep(p, n) {
			out = append(out, p)
		}
	}
	sort.Strings(out)
	return out
}

func (m *model) names(in *minode) int {
	k := 0
	for _, n := range m.nodes {
		if n.ino == in {
			k++
		}
	}
	return k
}

// own returns the inode of file p, for a change.
func (m *model) own(p string) *minode { return m.nodes[p].ino }

func under(p, dir string) bool { return p == dir || strings.HasPrefix(p, dir+"/") }

func depth(p string) int { return strings.Count(p, "/") }

// modelGen generates random operations, applying each to the model and
// appending its shell form to a script.
type modelGen struct {
	rng    *rand.Rand
	m      *model
	script strings.Builder
	// pending host-side writes are flushed in order with the script.
	write func(path string, data []byte, mode os.FileMode, appendTo bool)
}

var (
	namePool  = []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	fileModes = []uint32{0o644, 0o600, 0o755, 0o700, 0o444, 0o640, 0o000, 0o711}
	dirModes  = []uint32{0o755, 0o700, 0o555, 0o1777, 0o711, 0o750, 0o000}
	linkDests = []string{"a", "../b", "/w/c", "/", "/etc/passwd", "../../../../..", "nowhere/x", "/w", ".", "c/d/e"}
	wfModes   = []os.FileMode{0o600, 0o644, 0o640, 0o755, 0o700}
)

const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n.-_%\\"

func (g *modelGen) text(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = alphabet[g.rng.Intn(len(alphabet))]
	}
	return b
}

func (g *modelGen) pick(list []string) (string, bool) {
	if len(list) == 0 {
		return "", false
	}
	return list[g.rng.Intn(len(list))], true
}

func (g *modelGen) dirs(maxDepth int) []string {
	return g.m.sorted(func(p string, n *mnode) bool { return n.kind == 'd' && depth(p) <= maxDepth })
}

func (g *modelGen) files(small bool) []string {
	return g.m.sorted(func(p string, n *mnode) bool { return n.kind == 'f' && (!small || !n.ino.sparse) })
}

// newName returns a free name in a random directory.
func (g *modelGen) newName(maxDepth int) (string, bool) {
	d, ok := g.pick(g.dirs(maxDepth))
	if !ok {
		return "", false
	}
	for range 4 {
		p := d + "/" + namePool[g.rng.Intn(len(namePool))]
		if g.m.nodes[p] == nil {
			return p, true
		}
	}
	return "", false
}

func (g *modelGen) sh(format string, args ...any) {
	fmt.Fprintf(&g.script, format+"\n", args...)
}

func q(b []byte) string { return "'" + string(b) + "'" }

// content returns new small-file data and the shell that prints it.
func (g *modelGen) content() ([]byte, string) {
	switch r := g.rng.Intn(100); {
	case r < 5: // a larger file, cheap to make
		word := string(g.text(1 + g.rng.Intn(8)))
		word = strings.NewReplacer("\n", "x", " ", "y", "%", "p", "\\", "s").Replace(word)
		n := 10_000 + g.rng.Intn(300_000)
		rep := bytes.Repeat([]byte(word+"\n"), n/(len(word)+1)+1)[:n]
		return rep, fmt.Sprintf("yes %s | head -c %d", word, n)
	case r < 30:
		d := g.text(200 + g.rng.Intn(3800))
		return d, "printf '%s' " + q(d)
	default:
		d := g.text(g.rng.Intn(200))
		return d, "printf '%s' " + q(d)
	}
}

// step generates one operation; it reports false when the one it drew
// does not apply to the current tree.
func (g *modelGen) step() bool {
	m := g.m
	switch op := g.rng.Intn(100); {
	case op < 14: // create or overwrite a small file
		p, ok := g.pick(g.files(true))
		if !ok || g.rng.Intn(2) == 0 {
			if p, ok = g.newName(4); !ok {
				return false
			}
		}
		data, cmd := g.content()
		if n := m.nodes[p]; n != nil {
			g.m.own(p).data = data
		} else {
			m.nodes[p] = &mnode{kind: 'f', ino: newFile(0o644, data)}
		}
		g.sh("%s > %s", cmd, p)
	case op < 22: // append
		p, ok := g.pick(g.files(true))
		if !ok {
			return false
		}
		data, cmd := g.content()
		in := m.own(p)
		in.data = append(slices.Clone(in.data), data...)
		g.sh("%s >> %s", cmd, p)
	case op < 27: // truncate a small file
		p, ok := g.pick(g.files(true))
		if !ok {
			return false
		}
		n := g.rng.Intn(5000)
		in := m.own(p)
		d := make([]byte, n)
		copy(d, in.data)
		in.data = d
		g.sh("truncate -s %d %s", n, p)
	case op < 35: // delete a file or symlink
		p, ok := g.pick(m.sorted(func(_ string, n *mnode) bool { return n.kind != 'd' }))
		if !ok {
			return false
		}
		delete(m.nodes, p)
		g.sh("rm %s", p)
	case op < 43: // rename a file or symlink, to a new name or over a file
		src, ok := g.pick(m.sorted(func(_ string, n *mnode) bool { return n.kind != 'd' }))
		if !ok {
			return false
		}
		dst, ok := g.pick(g.files(false))
		if !ok || g.rng.Intn(2) == 0 {
			if dst, ok = g.newName(4); !ok {
				return false
			}
		}
		sn, dn := m.nodes[src], m.nodes[dst]
		if src == dst || (dn != nil && sn.ino != nil && sn.ino == dn.ino) {
			return false
		}
		if sn.kind == 'f' {
			m.own(src)
		}
		delete(m.nodes, src)
		m.nodes[dst] = sn
		g.sh("mv -f %s %s", src, dst)
	case op < 49: // mkdir
		p, ok := g.newName(3)
		if !ok {
			return false
		}
		mode := dirModes[g.rng.Intn(len(dirModes))]
		m.nodes[p] = &mnode{kind: 'd', mode: mode}
		g.sh("mkdir -m %o %s", mode, p)
	case op < 52: // rmdir an empty directory
		p, ok := g.pick(m.sorted(func(p string, n *mnode) bool {
			if n.kind != 'd' || p == "/w" {
				return false
			}
			for q := range m.nodes {
				if strings.HasPrefix(q, p+"/") {
					return false
				}
			}
			return true
		}))
		if !ok {
			return false
		}
		delete(m.nodes, p)
		g.sh("rmdir %s", p)
	case op < 56: // rm -rf a directory, and maybe make it again (opaque)
		p, ok := g.pick(m.sorted(func(p string, n *mnode) bool { return n.kind == 'd' && p != "/w" }))
		if !ok {
			return false
		}
		for q := range m.nodes {
			if under(q, p) {
				delete(m.nodes, q)
			}
		}
		g.sh("rm -rf %s", p)
		if g.rng.Intn(2) == 0 {
			m.nodes[p] = &mnode{kind: 'd', mode: 0o755}
			g.sh("mkdir %s", p)
			if g.rng.Intn(2) == 0 {
				data, cmd := g.content()
				m.nodes[p+"/a"] = &mnode{kind: 'f', ino: newFile(0o644, data)}
				g.sh("%s > %s/a", cmd, p)
			}
		}
	case op < 61: // rename a directory
		return g.renameDir()
	case op < 67: // chmod
		p, ok := g.pick(m.sorted(func(_ string, n *mnode) bool { return n.kind != 'l' }))
		if !ok {
			return false
		}
		n := m.nodes[p]
		if n.kind == 'd' {
			n.mode = dirModes[g.rng.Intn(len(dirModes))]
			g.sh("chmod %o %s", n.mode, p)
		} else {
			in := m.own(p)
			in.mode = fileModes[g.rng.Intn(len(fileModes))]
			g.sh("chmod %o %s", in.mode, p)
		}
	case op < 73: // symlink
		p, ok := g.newName(4)
		if !ok {
			return false
		}
		t := linkDests[g.rng.Intn(len(linkDests))]
		m.nodes[p] = &mnode{kind: 'l', target: t}
		g.sh("ln -s %s %s", t, p)
	case op < 80: // hard link
		src, ok := g.pick(g.files(false))
		if !ok {
			return false
		}
		dst, ok := g.newName(4)
		if !ok {
			return false
		}
		in := m.own(src)
		m.nodes[dst] = &mnode{kind: 'f', ino: in}
		g.sh("ln %s %s", src, dst)
	case op < 86: // sparse files: create, write a probe block, resize
		return g.sparse()
	case op < 93: // user xattrs
		p, ok := g.pick(g.files(false))
		if !ok {
			return false
		}
		k := "user." + namePool[g.rng.Intn(3)]
		in := m.nodes[p].ino
		if _, has := in.xattrs[k]; has && g.rng.Intn(3) == 0 {
			in = m.own(p)
			delete(in.xattrs, k)
			g.sh("%s rm %s %s", modelXA, p, k)
			return true
		}
		v := strings.NewReplacer("\n", "n", " ", "s", "%", "p", "\\", "b").Replace(string(g.text(1 + g.rng.Intn(40))))
		in = m.own(p)
		in.xattrs[k] = v
		g.sh("%s set %s %s '%s'", modelXA, p, k, v)
	default: // a write through the file API, outside any command
		p, ok := g.pick(g.files(true))
		if !ok || g.rng.Intn(2) == 0 {
			if p, ok = g.newName(4); !ok {
				return false
			}
		}
		data := g.text(g.rng.Intn(3000))
		appendTo := g.rng.Intn(3) == 0
		mode := wfModes[g.rng.Intn(len(wfModes))]
		if n := m.nodes[p]; n != nil {
			in := m.own(p)
			if appendTo {
				in.data = append(slices.Clone(in.data), data...)
			} else {
				in.data = data
			}
		} else {
			m.nodes[p] = &mnode{kind: 'f', ino: newFile(uint32(mode), data)}
		}
		g.write(p, data, mode, appendTo)
	}
	return true
}

// renameDir renames a directory to a new name, when the outcome does not
// depend on whether the kernel renames it or busybox mv copies it (EXDEV).
func (g *modelGen) renameDir() bool {
	m := g.m
	src, ok := g.pick(m.sorted(func(p string, n *mnode) bool { return n.kind == 'd' && p != "/w" }))
	if !ok {
		return false
	}
	inside := map[*minode]bool{}
	for p, n := range m.nodes {
		if under(p, src) && n.ino != nil {
			if n.ino.sparse || len(n.ino.xattrs) > 0 {
				return false
			}
			inside[n.ino] = true
		}
	}
	for in := range inside {
		// busybox cp finds hard links by (st_dev, st_ino), which overlayfs
		// does not report consistently for the names of a copied-up file.
		if m.names(in) != 1 {
			return false
		}
	}
	parent, ok := g.pick(m.sorted(func(p string, n *mnode) bool {
		return n.kind == 'd' && !under(p, src) && depth(p)+depth(src)-depth(path.Dir(src)) <= 4
	}))
	if !ok {
		return false
	}
	dst := parent + "/" + namePool[g.rng.Intn(len(namePool))]
	if m.nodes[dst] != nil {
		return false
	}
	moved := map[*minode]*minode{}
	for _, p := range m.sorted(func(p string, _ *mnode) bool { return under(p, src) }) {
		n := m.nodes[p]
		delete(m.nodes, p)
		if n.ino != nil {
			// Either way the files end up in the upper layer.
			if moved[n.ino] == nil {
				moved[n.ino] = n.ino.clone()
			}
			n.ino = moved[n.ino]
		}
		m.nodes[dst+strings.TrimPrefix(p, src)] = n
	}
	g.sh("mv %s %s", src, dst)
	return true
}

// sparseSlack bounds the bytes a sparse file may have allocated: overlayfs
// copies up the data of a sparse file in 1 MiB chunks, holes skipped.
var sparseSlack = int64(len(probes)+2) << 20

var sparseSizes = []int64{64 << 20, 256 << 20, 1 << 30, 128<<20 + 1}

func (g *modelGen) sparse() bool {
	m := g.m
	big := m.sorted(func(_ string, n *mnode) bool { return n.kind == 'f' && n.ino.sparse })
	seen := map[*minode]bool{}
	for _, p := range big {
		seen[m.nodes[p].ino] = true
	}
	switch r := g.rng.Intn(10); {
	case r < 3 && len(seen) < 3:
		p, ok := g.newName(4)
		if !ok {
			return false
		}
		size := sparseSizes[g.rng.Intn(len(sparseSizes))]
		m.nodes[p] = &mnode{kind: 'f', ino: &minode{mode: 0o644, sparse: true, size: size, blocks: map[int64][]byte{}, xattrs: map[string]string{}}}
		g.sh("truncate -s %d %s", size, p)
	case r < 8:
		p, ok := g.pick(big)
		if !ok {
			return false
		}
		in := m.nodes[p].ino
		var fit []int64
		for _, o := range probes {
			if o+probeLen <= in.size {
				fit = append(fit, o)
			}
		}
		o := fit[g.rng.Intn(len(fit))]
		data := bytes.ReplaceAll(g.text(1+g.rng.Intn(60)), []byte("\n"), []byte("n"))
		off := int64(g.rng.Intn(probeLen - len(data)))
		in = m.own(p)
		blk := make([]byte, probeLen)
		copy(blk, in.blocks[o])
		copy(blk[off:], data)
		in.blocks[o] = blk
		g.sh("printf '%%s' %s | dd of=%s bs=1 seek=%d conv=notrunc 2>/dev/null", q(data), p, o+off)
	default:
		p, ok := g.pick(big)
		if !ok {
			return false
		}
		size := sparseSizes[g.rng.Intn(len(sparseSizes))]
		in := m.own(p)
		for o, blk := range in.blocks {
			switch {
			case o >= size:
				delete(in.blocks, o)
			case o+int64(len(blk)) > size:
				in.blocks[o] = slices.Clone(blk[:size-o])
			}
		}
		in.size = size
		g.sh("truncate -s %d %s", size, p)
	}
	return true
}

// listScript prints the tree under /w: one stat line per entry, symlink
// targets, digests and user xattrs.
var listScript = func() string {
	var ps []string
	for _, p := range probes {
		ps = append(ps, strconv.FormatInt(p, 10))
	}
	return `set -e
find /w -exec stat -c '%n|%f|%d:%i|%s|%b' {} +
echo '#links'
find /w -type l -exec stat -c '%N' {} +
echo '#sums'
find /w -type f -size -4096k -exec md5sum {} +
find /w -type f -size +4096k | while read f; do
	s=$(stat -c %s "$f")
	for o in ` + strings.Join(ps, " ") + `; do
		if [ $o -lt $s ]; then dd if="$f" bs=4096 skip=$((o/4096)) count=1 2>/dev/null; fi
	done | md5sum | sed "s|-\$|$f|"
done
echo '#xattrs'
find /w -type f -exec ` + modelXA + ` dump {} +
`
}()

type listed struct {
	mode   uint32
	devIno string
	size   int64
	blocks int64
	target string
	sum    string
	xattrs []string
}

func parseListing(out string) (map[string]*listed, error) {
	got := map[string]*listed{}
	section := ""
	for _, line := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
		if strings.HasPrefix(line, "#") {
			section = line
			continue
		}
		switch section {
		case "":
			f := strings.Split(line, "|")
			if len(f) != 5 {
				return nil, fmt.Errorf("stat line %q", line)
			}
			mode, err1 := strconv.ParseUint(f[1], 16, 32)
			size, err2 := strconv.ParseInt(f[3], 10, 64)
			blocks, err3 := strconv.ParseInt(f[4], 10, 64)
			if err := errors.Join(err1, err2, err3); err != nil {
				return nil, fmt.Errorf("stat line %q: %w", line, err)
			}
			got[f[0]] = &listed{mode: uint32(mode), devIno: f[2], size: size, blocks: blocks}
		case "#links":
			name, target, ok := strings.Cut(line, "' -> '")
			if !ok || got[strings.TrimPrefix(name, "'")] == nil {
				return nil, fmt.Errorf("link line %q", line)
			}
			got[strings.TrimPrefix(name, "'")].target = strings.TrimSuffix(target, "'")
		case "#sums":
			sum, name, ok := strings.Cut(line, "  ")
			if !ok || got[name] == nil {
				return nil, fmt.Errorf("sum line %q", line)
			}
			got[name].sum = sum
		case "#xattrs":
			name, kv, ok := strings.Cut(line, "|")
			if !ok || got[name] == nil {
				return nil, fmt.Errorf("xattr line %q", line)
			}
			got[name].xattrs = append(got[name].xattrs, kv)
		}
	}
	return got, nil
}

// diffTree compares a listing with the model and returns the differences.
// Hard-link groups are told by (st_dev, st_ino): with its index, overlayfs
// reports every name of a copied-up file with its origin's inode.
func diffTree(m *model, got map[string]*listed) []string {
	var diffs []string
	byIno := map[string][]string{}
	for p, l := range got {
		if l.mode&unix.S_IFMT == unix.S_IFREG {
			byIno[l.devIno] = append(byIno[l.devIno], p)
		}
	}
	mgroups := map[*minode][]string{}
	for _, p := range m.sorted(func(string, *mnode) bool { return true }) {
		n := m.nodes[p]
		l := got[p]
		if l == nil {
			diffs = append(diffs, fmt.Sprintf("%s: missing (want kind %c)", p, n.kind))
			continue
		}
		switch n.kind {
		case 'd':
			if l.mode != unix.S_IFDIR|n.mode {
				diffs = append(diffs, fmt.Sprintf("%s: mode %o, want dir %o", p, l.mode, n.mode))
			}
		case 'l':
			if l.mode&unix.S_IFMT != unix.S_IFLNK || l.target != n.target {
				diffs = append(diffs, fmt.Sprintf("%s: mode %o -> %q, want symlink -> %q", p, l.mode, l.target, n.target))
			}
		case 'f':
			in := n.ino
			mgroups[in] = append(mgroups[in], p)
			var xa []string
			for k, v := range in.xattrs {
				xa = append(xa, k+"="+v)
			}
			sort.Strings(xa)
			sort.Strings(l.xattrs)
			switch {
			case l.mode != unix.S_IFREG|in.mode:
				diffs = append(diffs, fmt.Sprintf("%s: mode %o, want file %o", p, l.mode, in.mode))
			case l.size != in.fileSize():
				diffs = append(diffs, fmt.Sprintf("%s: size %d, want %d", p, l.size, in.fileSize()))
			case l.sum != in.digest():
				diffs = append(diffs, fmt.Sprintf("%s: content differs (size %d)", p, l.size))
			case !slices.Equal(l.xattrs, xa):
				diffs = append(diffs, fmt.Sprintf("%s: xattrs %q, want %q", p, l.xattrs, xa))
			case in.sparse && l.blocks*512 > sparseSlack:
				diffs = append(diffs, fmt.Sprintf("%s: sparse file of %d bytes has %d blocks allocated", p, l.size, l.blocks))
			}
		}
	}
	for p := range got {
		if m.nodes[p] == nil {
			diffs = append(diffs, fmt.Sprintf("%s: unexpected entry (mode %o)", p, got[p].mode))
		}
	}
	// Hard-link groups: the names sharing an inode must be the same sets.
	want := map[string]string{}
	for _, ps := range mgroups {
		sort.Strings(ps)
		for _, p := range ps {
			want[p] = strings.Join(ps, ",")
		}
	}
	for _, ps := range byIno {
		sort.Strings(ps)
		for _, p := range ps {
			if w, ok := want[p]; ok && w != strings.Join(ps, ",") {
				diffs = append(diffs, fmt.Sprintf("%s: hard-link group {%s}, want {%s}", p, strings.Join(ps, ","), w))
			}
		}
	}
	sort.Strings(diffs)
	return diffs
}

func diffPaths(diffs []string) []string {
	var out []string
	for _, d := range diffs {
		p, _, _ := strings.Cut(d, ":")
		out = append(out, p)
	}
	return out
}

// xattrHelper builds the static xattr tool the model image carries.
func xattrHelper(t *testing.T) string {
	t.Helper()
	return buildStaticC(t, "xa", xaSource)
}

// buildStaticC compiles a one-file C program, static, with $CC (as make init builds dg-init),
// and returns the binary's path.
func buildStaticC(t *testing.T, name, source string, flags ...string) string {
	t.Helper()
	dir := t.TempDir()
	src := filepath.Join(dir, name+".c")
	if err := os.WriteFile(src, []byte(source), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, name)
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	args := append([]string{"-O2", "-static", "-Wall"}, flags...)
	if out, err := exec.Command(cc, append(args, "-o", bin, src)...).CombinedOutput(); err != nil {
		t.Fatalf("building the static helper %s with %s (as make init builds dg-init): %v\n%s", name, cc, err, out)
	}
	return bin
}

const xaSource = `#include <stdio.h>
#include <string.h>
#include <sys/xattr.h>

/* xa set PATH NAME VALUE | xa rm PATH NAME | xa dump PATH...: the test's
   stand-in for setfattr/getfattr, which busybox lacks. */
int main(int argc, char **argv) {
	static char names[65536], val[65536];
	if (argc == 5 && !strcmp(argv[1], "set")) {
		if (setxattr(argv[2], argv[3], argv[4], strlen(argv[4]), 0) == 0) return 0;
		perror(argv[2]);
		return 1;
	}
	if (argc == 4 && !strcmp(argv[1], "rm")) {
		if (removexattr(argv[2], argv[3]) == 0) return 0;
		perror(argv[2]);
		return 1;
	}
	if (argc >= 2 && !strcmp(argv[1], "dump")) {
		for (int i = 2; i < argc; i++) {
			ssize_t n = llistxattr(argv[i], names, sizeof names);
			if (n < 0) { perror(argv[i]); return 1; }
			for (char *p = names; p < names + n; p += strlen(p) + 1) {
				if (strncmp(p, "user.", 5)) continue;
				ssize_t v = lgetxattr(argv[i], p, val, sizeof val);
				if (v < 0) { perror(p); return 1; }
				printf("%s|%s=%.*s\n", argv[i], p, (int)v, val);
			}
		}
		return 0;
	}
	fputs("usage: xa set PATH NAME VALUE | xa rm PATH NAME | xa dump PATH...\n", stderr);
	return 2;
}
`

// modelImage imports an image "model": busybox, the xattr helper, and a
// tree under /w whose files live only in the image layer (so deletes are
// whiteouts over it from the start). It returns the model of that tree.
func modelImage(t *testing.T, b *bundle) *model {
	t.Helper()
	root := b.root // already imported as "busybox"; reused for a second image
	xa, err := os.ReadFile(xattrHelper(t))
	if err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "usr/local/bin"), 0o755))
	must(os.WriteFile(filepath.Join(root, modelXA), xa, 0o755))
	m := newModel()
	must(os.Mkdir(filepath.Join(root, "w"), 0o755))
	mkdir := func(p string, mode uint32) {
		must(os.Mkdir(filepath.Join(root, p), 0o700))
		must(unix.Chmod(filepath.Join(root, p), mode))
		m.nodes[p] = &mnode{kind: 'd', mode: mode}
	}
	file := func(p, data string, mode uint32) *minode {
		must(os.WriteFile(filepath.Join(root, p), []byte(data), 0o600))
		must(unix.Chmod(filepath.Join(root, p), mode))
		in := &minode{mode: mode, data: []byte(data), xattrs: map[string]string{}}
		m.nodes[p] = &mnode{kind: 'f', ino: in}
		return in
	}
	mkdir("/w/a", 0o755)
	mkdir("/w/a/b", 0o750)
	mkdir("/w/c", 0o1777)
	mkdir("/w/d", 0o755)
	file("/w/e", "image file e\n", 0o644)
	file("/w/a/f", "image file a/f\n", 0o600)
	file("/w/a/b/g", strings.Repeat("g", 5000), 0o755)
	file("/w/c/h", "", 0o644)
	in := file("/w/d/a", "linked twice\n", 0o640)
	must(os.Link(filepath.Join(root, "w/d/a"), filepath.Join(root, "w/d/b")))
	m.nodes["/w/d/b"] = &mnode{kind: 'f', ino: in}
	x := file("/w/d/c", "with an xattr\n", 0o644)
	must(unix.Setxattr(filepath.Join(root, "w/d/c"), "user.a", []byte("from-image"), 0))
	x.xattrs["user.a"] = "from-image"
	must(os.Symlink("../e", filepath.Join(root, "w/a/h")))
	m.nodes["/w/a/h"] = &mnode{kind: 'l', target: "../e"}
	if _, err := b.rt.ImportImage(t.Context(), "model", root); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestModelFileOps runs 4,000 random operations (400 with -short). To
// replay a failure: DG_MODEL_SEED=<seed>; DG_MODEL_CHECK_ALL=1 checks the
// tree after every step (without changing the operations) to find the first
// that diverges; DG_MODEL_PATHS="/w/x ..." adds paths to the steps printed;
// DG_MODEL_JOURNAL=<file> writes every step to a file.
func TestModelFileOps(t *testing.T) {
	// A shallow flattening depth: many restores and forks go through merged
	// layers, whose whiteouts and opaque marks the model then checks.
	b := setup(t, filesOnly, func(c *sandbox.Config) { c.FlattenDepth = 6 })
	ctx := t.Context()
	seed := time.Now().UnixNano()
	if v := os.Getenv("DG_MODEL_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseInt(v, 10, 64); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("seed %d (set DG_MODEL_SEED=%d to replay)", seed, seed)
	rng := rand.New(rand.NewSource(seed))
	checkRng := rand.New(rand.NewSource(seed + 1))    // checks do not shift the operations
	checkAll := os.Getenv("DG_MODEL_CHECK_ALL") != "" // to find the first step that diverges
	target := 4000
	if testing.Short() {
		target = 400
	}
	m := modelImage(t, b)
	s := b.create(t, sandbox.Spec{Image: "model"})

	var stats struct {
		ops, batches, checks, checkpoints, copied, restores, forks, releases, hostWrites int
		listing                                                                          time.Duration
	}
	var script strings.Builder
	// journal records every step (script lines shortened) for failure
	// messages: the steps that touched the paths that differ.
	var journal []string
	note := func(format string, args ...any) {
		journal = append(journal, fmt.Sprintf("[%d ops] ", stats.ops)+fmt.Sprintf(format, args...))
	}
	recent := func(paths ...string) string {
		if f := os.Getenv("DG_MODEL_JOURNAL"); f != "" {
			_ = os.WriteFile(f, []byte(strings.Join(journal, "\n")+"\n"), 0o644)
		}
		var out []string
		for _, j := range journal {
			keep := !strings.Contains(j, "] sh: ")
			for _, p := range paths {
				keep = keep || strings.Contains(j, p+" ") || strings.HasSuffix(j, p) || strings.Contains(j, p+"/")
			}
			if keep {
				out = append(out, j)
			}
		}
		return "steps (commands touching the paths, and every other step):\n  " + strings.Join(out[max(0, len(out)-80):], "\n  ")
	}
	flush := func() {
		t.Helper()
		if script.Len() == 0 {
			return
		}
		text := "set -e\numask 022\n" + script.String()
		script.Reset()
		res, err := s.Exec(ctx, sandbox.ExecRequest{Argv: []string{"/bin/sh"}, Stdin: []byte(text), Timeout: time.Minute})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("seed %d: batch failed: %v exit %d signal %q\nstderr: %s\nscript:\n%s\n%s", seed, err, res.ExitCode, res.Signal, res.Stderr, text, recent())
		}
		for _, line := range strings.Split(strings.TrimSuffix(text, "\n"), "\n")[2:] {
			if len(line) > 100 {
				line = line[:60] + "..." + line[len(line)-40:]
			}
			note("sh: %s", line)
		}
		stats.batches++
	}
	var check func(sb *sandbox.Sandbox, m *model, when string)
	g := &modelGen{rng: rng, m: m}
	g.write = func(p string, data []byte, mode os.FileMode, appendTo bool) {
		t.Helper()
		script.WriteString(g.script.String())
		g.script.Reset()
		flush()
		if err := s.WriteFile(ctx, p, data, mode, appendTo); err != nil {
			t.Fatalf("seed %d: WriteFile %s: %v\n%s", seed, p, err, recent())
		}
		note("WriteFile %s (%d bytes, mode %o, append %v)", p, len(data), mode, appendTo)
		if checkAll {
			check(s, g.m, "after WriteFile "+p)
		}
		stats.hostWrites++
	}
	check = func(sb *sandbox.Sandbox, m *model, when string) {
		t.Helper()
		start := time.Now()
		res, err := sb.Exec(ctx, sandbox.ExecRequest{Command: listScript, MaxOutput: 16 << 20, Timeout: time.Minute})
		if err != nil || res.ExitCode != 0 || res.StdoutTruncated {
			t.Fatalf("seed %d: listing: %v exit %d truncated %v\n%s", seed, err, res.ExitCode, res.StdoutTruncated, res.Stderr)
		}
		got, err := parseListing(string(res.Stdout))
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if d := diffTree(m, got); len(d) > 0 {
			t.Fatalf("seed %d, after %d ops, %s: the tree differs from the model:\n%s", seed, stats.ops, when, strings.Join(d[:min(len(d), 30)], "\n")+"\n"+recent(append(diffPaths(d), strings.Fields(os.Getenv("DG_MODEL_PATHS"))...)...))
		}
		// A few small files read back through the file API too.
		files := m.sorted(func(_ string, n *mnode) bool { return n.kind == 'f' && !n.ino.sparse })
		for range min(3, len(files)) {
			p := files[checkRng.Intn(len(files))]
			data, _, err := sb.ReadFile(ctx, p, 0, 0)
			if err != nil || !bytes.Equal(data, m.nodes[p].ino.data) {
				t.Fatalf("seed %d, %s: ReadFile %s: %d bytes, err %v, want %d bytes", seed, when, p, len(data), err, len(m.nodes[p].ino.data))
			}
		}
		stats.checks++
		stats.listing += time.Since(start)
	}

	type snap struct {
		id string
		m  *model
	}
	var snaps []snap
	bgLive := false
	check(s, m, "at the start")
	start := time.Now()
	for stats.ops < target {
		n := 1 + rng.Intn(40)
		for i := 0; i < n; {
			if g.step() {
				i++
			}
		}
		stats.ops += n
		script.WriteString(g.script.String())
		g.script.Reset()
		flush()
		if rng.Intn(5) == 0 || checkAll {
			check(s, m, "after a batch")
		}
		switch r := rng.Intn(100); {
		case r < 35: // checkpoint, sometimes with a live process (frozen-copy path)
			if !bgLive && rng.Intn(4) == 0 {
				if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "sleep 1000", Background: true}); err != nil {
					t.Fatal(err)
				}
				bgLive = true
			}
			ck, err := s.Checkpoint(ctx)
			if err != nil {
				t.Fatalf("seed %d: checkpoint: %v", seed, err)
			}
			snaps = append(snaps, snap{ck.ID, m.clone()})
			note("checkpoint %s (live process %v)", ck.ID, bgLive)
			if bgLive {
				stats.copied++
			}
			stats.checkpoints++
		case r < 57 && len(snaps) > 0: // restore a random earlier checkpoint
			sn := snaps[rng.Intn(len(snaps))]
			if err := s.Restore(ctx, sn.id); err != nil {
				t.Fatalf("seed %d: restore %s: %v", seed, sn.id, err)
			}
			bgLive = false
			m = sn.m.clone()
			g.m = m
			stats.restores++
			note("restore %s", sn.id)
			check(s, m, "after restore to "+sn.id)
		case r < 63 && len(snaps) > 0: // fork: check one child, go on in the other
			sn := snaps[rng.Intn(len(snaps))]
			kids, err := b.rt.Fork(ctx, sn.id, 2, sandbox.Spec{})
			if err != nil {
				t.Fatalf("seed %d: fork %s: %v", seed, sn.id, err)
			}
			for _, k := range kids {
				t.Cleanup(func() { _ = k.Destroy(context.Background()) })
			}
			check(kids[1], sn.m, "in a fork of "+sn.id)
			if err := kids[1].Destroy(ctx); err != nil {
				t.Fatal(err)
			}
			if err := s.Destroy(ctx); err != nil {
				t.Fatal(err)
			}
			s, bgLive = kids[0], false
			m = sn.m.clone()
			g.m = m
			stats.forks++
			note("fork of %s", sn.id)
			check(s, m, "in the fork of "+sn.id+" that goes on")
		case r < 66 && len(snaps) > 4: // release an old checkpoint
			i := rng.Intn(len(snaps) / 2)
			id := snaps[i].id
			if err := b.rt.ReleaseCheckpoint(id); err != nil {
				t.Fatalf("seed %d: release %s: %v", seed, id, err)
			}
			snaps = slices.Delete(snaps, i, i+1)
			if err := s.Restore(ctx, id); !errors.Is(err, sandbox.ErrNotFound) {
				t.Fatalf("seed %d: restore of released %s: %v, want ErrNotFound", seed, id, err)
			}
			stats.releases++
			note("release %s", id)
		}
	}
	check(s, m, "at the end")
	el := time.Since(start)
	kinds := map[string]int{}
	for _, j := range journal {
		for _, k := range [][2]string{{"dir renames", "] sh: mv /"}, {"file renames", "] sh: mv -f"}, {"xattr sets", " set /w"},
			{"sparse writes", "dd of="}, {"symlinks", "] sh: ln -s"}, {"hard links", "] sh: ln /"}, {"rm -rf", "] sh: rm -rf"},
			{"chmods", "] sh: chmod"}, {"truncates", "] sh: truncate"}} {
			if strings.Contains(j, k[1]) {
				kinds[k[0]]++
			}
		}
	}
	t.Logf("some of the commands: %v", kinds)
	t.Logf("%d ops in %d batches (%d through WriteFile), %d checkpoints (%d with a live process), %d restores, %d forks, %d releases, %d tree checks (%v listing): %v",
		stats.ops, stats.batches, stats.hostWrites, stats.checkpoints, stats.copied, stats.restores, stats.forks, stats.releases, stats.checks, stats.listing.Round(time.Millisecond), el.Round(time.Millisecond))
}

// A file with several names is checkpointed, then changed through one name:
// POSIX says the other names show the change, and every later checkpoint,
// restore and fork must keep it so. overlayfs copies up the changed name
// alone; its index makes the live mount show the others as the copy, and
// the seal puts them into the layer too (overlay.Links).
func TestHardlinksKeptAcrossCheckpoints(t *testing.T) {
	b := setup(t)
	cases := []struct {
		name      string
		before    string // after the files are made, before the first checkpoint
		change    string // after the first checkpoint
		live      bool   // a background process runs: the checkpoint copies the upper
		check     string
		want      string
		wantDepth int
	}{
		{name: "sealed", change: "echo new > /w/a",
			check: "cat /w/a /w/b /w/c; stat -c %h /w/a /w/b", want: "new\nnew\nnew\n3\n3\n", wantDepth: 2},
		{name: "live process", change: "echo new > /w/a", live: true,
			check: "cat /w/a /w/b /w/c; stat -c %h /w/a", want: "new\nnew\nnew\n3\n", wantDepth: 2},
		{name: "changed name removed", change: "echo new > /w/a; rm /w/a",
			check: "cat /w/b /w/c; stat -c %h /w/b; test ! -e /w/a", want: "new\nnew\n2\n", wantDepth: 2},
		{name: "changed name renamed", change: "echo new > /w/a; mv /w/a /w/d",
			check: "cat /w/b /w/c /w/d; stat -c %h /w/d; test ! -e /w/a", want: "new\nnew\nnew\n3\n", wantDepth: 2},
		{name: "a name replaced", change: "rm /w/c; echo other > /w/c; echo new > /w/b",
			check: "cat /w/a /w/b /w/c; stat -c %h /w/a /w/c", want: "new\nnew\nother\n2\n1\n", wantDepth: 2},
		{name: "a name in another directory", before: "mkdir /w/d; ln /w/a /w/d/e", change: "echo new >> /w/d/e",
			check: "cat /w/a /w/c; stat -c %h /w/a", want: "old\nnew\nold\nnew\n4\n", wantDepth: 2},
		{name: "change through an open fd", change: "exec 3>>/w/c; echo new >&3",
			check: "cat /w/a; stat -c %h /w/b", want: "old\nnew\n3\n", wantDepth: 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := t.Context()
			s := b.create(t, sandbox.Spec{})
			sh(t, s, "mkdir /w; echo old > /w/a; ln /w/a /w/b; ln /w/a /w/c")
			if tc.before != "" {
				sh(t, s, tc.before)
			}
			if _, err := s.Checkpoint(ctx); err != nil {
				t.Fatal(err)
			}
			if tc.live {
				if _, err := s.Exec(ctx, sandbox.ExecRequest{Command: "sleep 1000", Background: true}); err != nil {
					t.Fatal(err)
				}
			}
			sh(t, s, tc.change)
			if out := sh(t, s, tc.check); out != tc.want {
				t.Fatalf("in the live sandbox: %q, want %q", out, tc.want)
			}
			ck, err := s.Checkpoint(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if ck.Depth != tc.wantDepth {
				t.Fatalf("checkpoint depth %d, want %d (the change in a layer of its own)", ck.Depth, tc.wantDepth)
			}
			if out := sh(t, s, tc.check); out != tc.want {
				t.Fatalf("after the checkpoint: %q, want %q", out, tc.want)
			}
			if err := s.Restore(ctx, ck.ID); err != nil {
				t.Fatal(err)
			}
			if out := sh(t, s, tc.check); out != tc.want {
				t.Fatalf("after restoring the checkpoint: %q, want %q", out, tc.want)
			}
			kids, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = kids[0].Destroy(context.Background()) })
			if out := sh(t, kids[0], tc.check); out != tc.want {
				t.Fatalf("in a fork of the checkpoint: %q, want %q", out, tc.want)
			}
			// Once more on top: the group now lives in the sealed layer.
			sh(t, kids[0], "echo newer > /w/b")
			ck2, err := kids[0].Checkpoint(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Restore(ctx, ck2.ID); err != nil {
				t.Fatal(err)
			}
			// Every name of /w/b's inode shows the new content.
			out := sh(t, s, `i=$(stat -c %i /w/b); n=$(stat -c %h /w/b); k=0
for f in /w/* /w/*/*; do if [ -f "$f" ] && [ "$(stat -c %i "$f")" = "$i" ] && [ "$(cat "$f")" = newer ]; then k=$((k+1)); fi; done
echo $n $k`)
			var n, k int
			if _, err := fmt.Sscan(out, &n, &k); err != nil || n < 2 || n != k {
				t.Fatalf("after a second change, checkpoint and restore: %q, want \"N N\" (names of /w/b, names showing the change)", out)
			}
		})
	}
}

// The same with the link group in the image's layer (on the data
// directory's filesystem, not a delta layer's tmpfs).
func TestHardlinksKeptInImage(t *testing.T) {
	b := setup(t)
	ctx := t.Context()
	root := b.root // already imported as "busybox"; reused for a second image
	for _, err := range []error{
		os.MkdirAll(filepath.Join(root, "w/d"), 0o755),
		os.WriteFile(filepath.Join(root, "w/a"), []byte("old\n"), 0o644),
		os.Link(filepath.Join(root, "w/a"), filepath.Join(root, "w/b")),
		os.Link(filepath.Join(root, "w/a"), filepath.Join(root, "w/d/c")),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.rt.ImportImage(ctx, "linked", root); err != nil {
		t.Fatal(err)
	}
	s := b.create(t, sandbox.Spec{Image: "linked"})
	const check, want = "cat /w/a /w/b /w/d/c; stat -c %h /w/b", "new\nnew\nnew\n3\n"
	sh(t, s, "echo new > /w/d/c")
	if out := sh(t, s, check); out != want {
		t.Fatalf("in the live sandbox: %q, want %q", out, want)
	}
	ck, err := s.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Restore(ctx, ck.ID); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, s, check); out != want {
		t.Fatalf("after restoring the checkpoint: %q, want %q", out, want)
	}
	kids, err := b.rt.Fork(ctx, ck.ID, 1, sandbox.Spec{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kids[0].Destroy(context.Background()) })
	if out := sh(t, kids[0], check); out != want {
		t.Fatalf("in a fork of the checkpoint: %q, want %q", out, want)
	}
}
