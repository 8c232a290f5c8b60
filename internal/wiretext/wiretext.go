// Package wiretext holds the one rule for text a sandbox controls — a file's name, a process's
// name or command line, a message that quotes one — on its way into a protobuf string field, a
// JSON string or a Postgres text column, none of which may hold bytes that are not UTF-8: each
// byte that is not part of a valid UTF-8 sequence becomes U+FFFD, the replacement character.
// Valid text passes unchanged. The rule is lossy (two names that differ only in such bytes read
// the same) and it is encoding/json's, so the server's JSON front ends, which marshal with it,
// show such text exactly as its protobuf ones do.
package wiretext

import (
	"strings"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Replacement is what each byte that is not UTF-8 becomes.
const Replacement = "\uFFFD"

// String is s with each byte that is not part of a valid UTF-8 sequence replaced by
// U+FFFD; s itself when it is valid.
func String(s string) string {
	if utf8.ValidString(s) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 2*len(Replacement))
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			b.WriteString(Replacement)
		} else {
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// Message applies String, in place, to every string of m: its fields, those of the messages
// it holds, the elements of its lists and the keys and values of its maps. It reports whether
// it changed any. Bytes fields are left as they are: they may hold anything.
func Message(m proto.Message) bool {
	if m == nil {
		return false
	}
	return message(m.ProtoReflect())
}

func message(m protoreflect.Message) bool {
	changed := false
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsMap():
			changed = mapValues(fd, v.Map()) || changed
		case fd.IsList():
			l := v.List()
			for i := range l.Len() {
				if e, ok := value(fd, l.Get(i)); ok {
					l.Set(i, e)
					changed = true
				}
			}
		default:
			if e, ok := value(fd, v); ok {
				m.Set(fd, e) // Range allows setting the field it is at
				changed = true
			}
		}
		return true
	})
	return changed
}

// value is v, a value of field fd (or a list's element of it), made valid, and whether that
// changed it; a message is changed in place and returned itself.
func value(fd protoreflect.FieldDescriptor, v protoreflect.Value) (protoreflect.Value, bool) {
	switch fd.Kind() {
	case protoreflect.StringKind:
		if s := v.String(); !utf8.ValidString(s) {
			return protoreflect.ValueOfString(String(s)), true
		}
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return v, message(v.Message())
	}
	return v, false
}

// mapValues makes the keys and values of map field fd valid. A key that changes is moved to
// its valid form; of keys that read the same after it, one's value is kept.
func mapValues(fd protoreflect.FieldDescriptor, mp protoreflect.Map) bool {
	type entry struct {
		key protoreflect.MapKey
		val protoreflect.Value
	}
	var set []entry
	var drop []protoreflect.MapKey
	mp.Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
		nv, changed := value(fd.MapValue(), v)
		nk := k
		if fd.MapKey().Kind() == protoreflect.StringKind {
			if s := k.String(); !utf8.ValidString(s) {
				nk = protoreflect.ValueOfString(String(s)).MapKey()
				drop = append(drop, k)
				changed = true
			}
		}
		if changed {
			set = append(set, entry{nk, nv})
		}
		return true
	})
	for _, k := range drop {
		mp.Clear(k)
	}
	for _, e := range set {
		mp.Set(e.key, e.val)
	}
	return len(set) > 0
}
