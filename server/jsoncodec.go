package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// jsonCodec is connect's JSON codec but for one thing: an enum value given by a name the
// schema does not have is refused (InvalidArgument), where connect's codec takes it for the
// enum's zero value. A checkpoint asked for with "processMode": "CRIU" (the name is
// PROCESS_MODE_CRIU) would otherwise be taken with the env's default mode, and say nothing.
// Unknown fields are still ignored, as connect does, so that a newer client's requests are
// served. A response holding text that is not UTF-8 is sent made valid (marshalValid), as the
// binary codec sends it.
//
// A request is read strictly first: nearly all are, in one pass. One the strict read refuses
// is read as connect reads it (unknown fields and enum names ignored), and if that succeeds,
// the JSON is walked along the message's descriptor for an enum name the schema lacks, in the
// fields it knows; what the walk finds is the error.
type jsonCodec struct{ name string }

// jsonCodecs replace connect's for both names it serves JSON under.
func jsonCodecs() []connect.HandlerOption {
	return []connect.HandlerOption{
		connect.WithCodec(jsonCodec{"json"}),
		connect.WithCodec(jsonCodec{"json; charset=utf-8"}),
	}
}

func (c jsonCodec) Name() string { return c.name }

func (c jsonCodec) IsBinary() bool { return false }

// Marshal is protojson's, with text that is not UTF-8 made valid (marshalValid).
func (c jsonCodec) Marshal(m any) ([]byte, error) {
	return marshalValid(m, func(pm proto.Message) ([]byte, error) { return protojson.MarshalOptions{}.Marshal(pm) })
}

func (c jsonCodec) MarshalAppend(dst []byte, m any) ([]byte, error) {
	return marshalValid(m, func(pm proto.Message) ([]byte, error) { return protojson.MarshalOptions{}.MarshalAppend(dst, pm) })
}

// MarshalStable is Marshal with protojson's varying whitespace taken out.
func (c jsonCodec) MarshalStable(m any) ([]byte, error) {
	b, err := c.Marshal(m)
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	if err := json.Compact(&out, b); err != nil {
		return nil, err
	}
	return out.Bytes(), nil
}

func (c jsonCodec) Unmarshal(b []byte, m any) error {
	pm, ok := m.(proto.Message)
	if !ok {
		return fmt.Errorf("%T is not a proto.Message", m)
	}
	if len(b) == 0 {
		return errors.New("zero-length payload is not a valid JSON object")
	}
	if protojson.Unmarshal(b, pm) == nil {
		return nil
	}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(b, pm); err != nil {
		return fmt.Errorf("unmarshal into %T: %w", m, err)
	}
	var v any
	if err := json.Unmarshal(b, &v); err != nil { // protojson took it: cannot fail
		return fmt.Errorf("unmarshal into %T: %w", m, err)
	}
	if err := checkEnumNames(pm.ProtoReflect().Descriptor(), v, ""); err != nil {
		proto.Reset(pm)
		return fmt.Errorf("unmarshal into %T: %w", m, err)
	}
	return nil
}

// checkEnumNames walks v, the JSON of a message of type md, and returns an error naming the
// first enum value given by a name the enum lacks, in a field md knows. Unknown fields and the
// well-known types (their JSON is not a message's) are skipped.
func checkEnumNames(md protoreflect.MessageDescriptor, v any, path string) error {
	obj, ok := v.(map[string]any)
	if !ok || strings.HasPrefix(string(md.FullName()), "google.protobuf.") {
		return nil
	}
	fields := md.Fields()
	for key, val := range obj {
		f := fields.ByJSONName(key)
		if f == nil {
			f = fields.ByTextName(key)
		}
		if f == nil || val == nil {
			continue
		}
		p := key
		if path != "" {
			p = path + "." + key
		}
		var vals []any
		switch {
		case f.IsMap():
			m, _ := val.(map[string]any)
			for k, x := range m {
				if err := checkValue(f.MapValue(), x, p+"["+k+"]"); err != nil {
					return err
				}
			}
			continue
		case f.IsList():
			vals, _ = val.([]any)
		default:
			vals = []any{val}
		}
		for i, x := range vals {
			q := p
			if f.IsList() {
				q = fmt.Sprintf("%s[%d]", p, i)
			}
			if err := checkValue(f, x, q); err != nil {
				return err
			}
		}
	}
	return nil
}

// checkValue checks one value of field f (a list's element or a map's value).
func checkValue(f protoreflect.FieldDescriptor, x any, path string) error {
	switch f.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return checkEnumNames(f.Message(), x, path)
	case protoreflect.EnumKind:
		name, ok := x.(string)
		ed := f.Enum()
		if !ok || ed.FullName() == "google.protobuf.NullValue" || ed.Values().ByName(protoreflect.Name(name)) != nil {
			return nil
		}
		vals := ed.Values()
		names := make([]string, vals.Len())
		for i := range names {
			names[i] = string(vals.Get(i).Name())
		}
		return fmt.Errorf("%s: %q is not a value of %s (%s, or their numbers)", path, name, ed.Name(), strings.Join(names, ", "))
	}
	return nil
}
