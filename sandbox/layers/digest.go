package layers

import (
	"fmt"
	"io"
)

// Digest returns the digest of sealed layer id: "sha256:" and the hex
// SHA-256 of the stream Export writes for it. The first call reads the
// layer and hashes its stream, writing it nowhere; the digest is kept in
// the store with the layer (a sealed layer never changes) until the layer
// is discarded or unsealed, so later calls cost a map look-up. A layer
// made by Import has its digest from the start.
func (s *Store) Digest(id string) (string, error) {
	for {
		s.mu.Lock()
		if d, ok := s.digests[id]; ok {
			s.mu.Unlock()
			return d, nil
		}
		wait, busy := s.hashing[id]
		if !busy {
			done := make(chan struct{})
			if s.hashing == nil {
				s.hashing = map[string]chan struct{}{}
			}
			s.hashing[id] = done
			s.mu.Unlock()
			d, err := s.Export(io.Discard, id)
			s.mu.Lock()
			delete(s.hashing, id)
			s.mu.Unlock()
			close(done)
			return d, err
		}
		s.mu.Unlock()
		<-wait // then the digest is known, or the first hash failed and this one tries
	}
}

// LayerByDigest returns a sealed layer of the store whose digest is digest,
// with a reference held by the caller, or ErrNotFound. Only layers whose
// digest is known are found: imported ones, and those Digest or Export
// hashed (after a restart, once Digest or Export hashes them again). A
// node asked for a layer it already holds (an earlier import, or its own
// layer sent back) uses it instead of importing it again.
func (s *Store) LayerByDigest(digest string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	id, ok := s.byDigest[digest]
	if !ok {
		return "", fmt.Errorf("%w: no layer with digest %s", ErrNotFound, digest)
	}
	s.refs[id]++
	return id, nil
}

// remember keeps digest d of sealed layer id.
//
// +checklocks:s.mu
func (s *Store) remember(id, d string) {
	s.digests[id] = d
	if _, ok := s.byDigest[d]; !ok {
		s.byDigest[d] = id
	}
}

// forgetDigest drops the digest of layer id, discarded or unsealed; another
// layer of the same digest, if the store holds one, takes its place in
// byDigest.
//
// +checklocks:s.mu
func (s *Store) forgetDigest(id string) {
	d, ok := s.digests[id]
	if !ok {
		return
	}
	delete(s.digests, id)
	if s.byDigest[d] != id {
		return
	}
	delete(s.byDigest, d)
	for other, od := range s.digests {
		if od == d {
			s.byDigest[d] = other
			return
		}
	}
}
