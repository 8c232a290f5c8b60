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
// served.
//
// protojson has no option for that split: a request is read strictly first, and read again
// ignoring what is unknown only when the strict read stopped at an unknown field. A request
// with both an unknown field and an unknown enum name before it is still refused; one with the
// enum name after the field is taken as connect takes it.
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

func (c jsonCodec) Marshal(m any) ([]byte, error) {
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("%T is not a proto.Message", m)
	}
	return protojson.MarshalOptions{}.Marshal(pm)
}

func (c jsonCodec) MarshalAppend(dst []byte, m any) ([]byte, error) {
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("%T is not a proto.Message", m)
	}
	return protojson.MarshalOptions{}.MarshalAppend(dst, pm)
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
	err := protojson.Unmarshal(b, pm)
	if err != nil && strings.Contains(err.Error(), "unknown field") {
		proto.Reset(pm)
		err = protojson.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(b, pm)
	}
	if err != nil {
		if _, field, ok := strings.Cut(err.Error(), "invalid value for enum field "); ok {
			field, _, _ = strings.Cut(field, ":")
			if names := enumNames(pm.ProtoReflect().Descriptor(), field, nil); names != nil {
				return fmt.Errorf("unmarshal into %T: %w (%s takes %s, or their numbers)", m, err, field, strings.Join(names, ", "))
			}
		}
		return fmt.Errorf("unmarshal into %T: %w", m, err)
	}
	return nil
}

// enumNames returns the value names of the enum field called jsonName (or by its proto name)
// in md or a message below it, nil if there is none.
func enumNames(md protoreflect.MessageDescriptor, jsonName string, seen map[protoreflect.FullName]bool) []string {
	if seen == nil {
		seen = map[protoreflect.FullName]bool{}
	}
	if seen[md.FullName()] {
		return nil
	}
	seen[md.FullName()] = true
	fields := md.Fields()
	for i := range fields.Len() {
		f := fields.Get(i)
		if ed := f.Enum(); ed != nil && (f.JSONName() == jsonName || string(f.Name()) == jsonName) {
			vals := ed.Values()
			names := make([]string, vals.Len())
			for j := range names {
				names[j] = string(vals.Get(j).Name())
			}
			return names
		}
	}
	for i := range fields.Len() {
		if sub := fields.Get(i).Message(); sub != nil {
			if names := enumNames(sub, jsonName, seen); names != nil {
				return names
			}
		}
	}
	return nil
}
