package assignment

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"
)

// DefaultMaxBytes is the size cap the agent applies to an Assignment body.
const DefaultMaxBytes int64 = 1 << 20

// ErrTooLarge is returned by Decode when the body exceeds the size cap.
var ErrTooLarge = errors.New("body exceeds the size limit")

// FieldError is one problem with one field. Path is the field's JSON path, such as
// "downstreams[2].acquireTimeout"; "body" when the problem is with the whole document.
type FieldError struct {
	Path    string
	Message string
}

func (e *FieldError) Error() string { return e.Path + ": " + e.Message }

// FieldErrors returns every *FieldError joined in err (by Decode, DecodeBootstrap or Validate),
// in order. It returns nil when err holds none.
func FieldErrors(err error) []*FieldError {
	var out []*FieldError
	var walk func(error)
	walk = func(e error) {
		if j, ok := e.(interface{ Unwrap() []error }); ok {
			for _, x := range j.Unwrap() {
				walk(x)
			}
			return
		}
		var fe *FieldError
		if errors.As(e, &fe) {
			out = append(out, fe)
		}
	}
	walk(err)
	return out
}

// Decode reads exactly one JSON Assignment of at most maxBytes bytes from r and validates it.
//
// Decoding is strict: unknown fields (matched case-sensitively), duplicate fields, values of
// the wrong type, trailing data after the value and numbers given for durations are refused.
// A body larger than maxBytes yields an error wrapping ErrTooLarge. Every other problem is a
// *FieldError naming the field's path; all of them are collected with errors.Join, so one
// answer lists everything that is wrong. The Assignment is returned only when err is nil.
func Decode(r io.Reader, maxBytes int64) (*Assignment, error) {
	a, err := decode(r, maxBytes)
	if err != nil {
		return nil, err
	}
	if err := a.Validate(); err != nil {
		return nil, err
	}
	return a, nil
}

// DecodeBootstrap reads an Assignment meant for an agent's --bootstrap file: the same strict
// decoding and validation as Decode, except that epoch, generation and leaseTTL may be omitted
// (they must otherwise be valid). The caller applies it as epoch 0, generation 0, on safe
// defaults, so any Assignment pushed by a manager replaces it.
func DecodeBootstrap(r io.Reader, maxBytes int64) (*Assignment, error) {
	a, err := decode(r, maxBytes)
	if err != nil {
		return nil, err
	}
	if err := a.validate(true); err != nil {
		return nil, err
	}
	return a, nil
}

func decode(r io.Reader, maxBytes int64) (*Assignment, error) {
	if maxBytes <= 0 {
		maxBytes = DefaultMaxBytes
	}
	data, err := io.ReadAll(io.LimitReader(r, maxBytes+1))
	if err != nil {
		return nil, fmt.Errorf("reading body: %w", err)
	}
	if int64(len(data)) > maxBytes {
		return nil, fmt.Errorf("%w of %d bytes", ErrTooLarge, maxBytes)
	}
	// Exactly one JSON value.
	dec := json.NewDecoder(bytes.NewReader(data))
	var raw json.RawMessage
	if err := dec.Decode(&raw); err != nil {
		return nil, &FieldError{Path: "body", Message: syntaxMessage(err, data)}
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, &FieldError{Path: "body", Message: "must hold exactly one JSON value; found data after it"}
	}
	// Shape check first: it names the path of every unknown, duplicate or mistyped field,
	// which encoding/json does not.
	if errs := checkShape(raw, reflect.TypeFor[Assignment](), ""); len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	dec = json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var a Assignment
	if err := dec.Decode(&a); err != nil {
		// Unreachable when checkShape agrees with encoding/json; kept as a backstop.
		return nil, &FieldError{Path: "body", Message: err.Error()}
	}
	return &a, nil
}

func syntaxMessage(err error, data []byte) string {
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return fmt.Sprintf("invalid JSON at byte %d: %s", se.Offset, strings.TrimPrefix(se.Error(), "json: "))
	}
	if errors.Is(err, io.EOF) {
		if len(bytes.TrimSpace(data)) == 0 {
			return "empty body; expected a JSON object"
		}
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return "truncated JSON"
	}
	return strings.TrimPrefix(err.Error(), "json: ")
}

func joinPath(base, name string) string {
	if base == "" {
		return name
	}
	return base + "." + name
}

func rootPath(p string) string {
	if p == "" {
		return "body"
	}
	return p
}

var (
	unmarshalerType = reflect.TypeFor[json.Unmarshaler]()
	fieldCache      sync.Map // reflect.Type -> map[string]reflect.StructField
)

// jsonFields maps the JSON names of t's exported fields to the fields.
func jsonFields(t reflect.Type) map[string]reflect.StructField {
	if m, ok := fieldCache.Load(t); ok {
		return m.(map[string]reflect.StructField)
	}
	m := make(map[string]reflect.StructField)
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		if name == "" {
			name = f.Name
		}
		m[name] = f
	}
	fieldCache.Store(t, m)
	return m
}

// checkShape walks raw against t and reports, with their paths, unknown or duplicate object
// members and values that do not decode into their field's type.
func checkShape(raw json.RawMessage, t reflect.Type, path string) []error {
	raw = bytes.TrimSpace(raw)
	if string(raw) == "null" {
		return nil // encoding/json leaves the zero value
	}
	if t.Kind() == reflect.Pointer {
		return checkShape(raw, t.Elem(), path)
	}
	if reflect.PointerTo(t).Implements(unmarshalerType) {
		return checkLeaf(raw, t, path)
	}
	switch t.Kind() {
	case reflect.Struct:
		return checkObject(raw, path, func(key string) (reflect.Type, string, bool) {
			f, ok := jsonFields(t)[key]
			if !ok {
				return nil, "", false
			}
			return f.Type, joinPath(path, key), true
		})
	case reflect.Map:
		if t.Key().Kind() != reflect.String {
			return []error{&FieldError{Path: rootPath(path), Message: "unsupported map type"}}
		}
		return checkObject(raw, path, func(key string) (reflect.Type, string, bool) {
			return t.Elem(), joinPath(path, strconv.Quote(key)), true
		})
	case reflect.Slice:
		if raw[0] != '[' {
			return []error{&FieldError{Path: rootPath(path), Message: "must be an array"}}
		}
		dec := json.NewDecoder(bytes.NewReader(raw))
		_, _ = dec.Token() // '['
		var errs []error
		for i := 0; dec.More(); i++ {
			var elem json.RawMessage
			if err := dec.Decode(&elem); err != nil {
				return append(errs, &FieldError{Path: rootPath(path), Message: err.Error()})
			}
			errs = append(errs, checkShape(elem, t.Elem(), fmt.Sprintf("%s[%d]", path, i))...)
		}
		return errs
	default:
		return checkLeaf(raw, t, path)
	}
}

func checkObject(raw json.RawMessage, path string, member func(key string) (reflect.Type, string, bool)) []error {
	if raw[0] != '{' {
		return []error{&FieldError{Path: rootPath(path), Message: "must be an object"}}
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	_, _ = dec.Token() // '{'
	seen := make(map[string]bool)
	var errs []error
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return append(errs, &FieldError{Path: rootPath(path), Message: err.Error()})
		}
		key, _ := tok.(string)
		var val json.RawMessage
		if err := dec.Decode(&val); err != nil {
			return append(errs, &FieldError{Path: rootPath(path), Message: err.Error()})
		}
		ft, fpath, ok := member(key)
		if !ok {
			errs = append(errs, &FieldError{Path: joinPath(path, key), Message: "unknown field"})
			continue
		}
		if seen[key] {
			errs = append(errs, &FieldError{Path: fpath, Message: "duplicate field"})
			continue
		}
		seen[key] = true
		errs = append(errs, checkShape(val, ft, fpath)...)
	}
	return errs
}

func checkLeaf(raw json.RawMessage, t reflect.Type, path string) []error {
	v := reflect.New(t)
	if err := json.Unmarshal(raw, v.Interface()); err != nil {
		return []error{&FieldError{Path: rootPath(path), Message: leafMessage(err, t)}}
	}
	return nil
}

func leafMessage(err error, t reflect.Type) string {
	if t == reflect.TypeFor[time.Time]() {
		return "must be an RFC 3339 time such as \"2026-01-02T15:04:05Z\""
	}
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		switch t.Kind() {
		case reflect.String:
			return "must be a string"
		case reflect.Bool:
			return "must be true or false"
		case reflect.Int32:
			return "must be a 32-bit integer"
		case reflect.Int64:
			return "must be a 64-bit integer"
		case reflect.Float64:
			return "must be a number"
		}
		return fmt.Sprintf("must be a JSON %s", jsonKind(t))
	}
	return strings.TrimPrefix(err.Error(), "json: ")
}

func jsonKind(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Struct, reflect.Map:
		return "object"
	case reflect.Slice, reflect.Array:
		return "array"
	}
	return t.Kind().String()
}
