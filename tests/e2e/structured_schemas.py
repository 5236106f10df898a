"""Twenty-odd varied Pydantic models for the structured-output acceptance tests and the
benchmark: nested objects, arrays with item bounds, enums, bounded numbers, optional
fields, anyOf unions, string formats and patterns. Strings carry a max length so that a
135M model cannot spin a single string to the token limit."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

Short = Field(max_length=24)
Word = Annotated[str, Field(max_length=16)]


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)


class City(BaseModel):
    name: str = Short
    country: str = Short
    population: int = Field(ge=0, le=50_000_000)


class Address(BaseModel):
    street: str = Short
    city: str = Short
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class PersonWithAddress(BaseModel):
    name: str = Short
    address: Address


class Tags(BaseModel):
    tags: list[Word] = Field(min_length=1, max_length=3)


class Scores(BaseModel):
    scores: list[int] = Field(min_length=2, max_length=4)


class Paint(BaseModel):
    color: Color
    coats: int = Field(ge=1, le=3)


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence: float = Field(ge=0.0, le=1.0)


class Weather(BaseModel):
    city: str = Short
    celsius: int = Field(ge=-50, le=60)
    raining: bool


class Book(BaseModel):
    title: str = Short
    year: int = Field(ge=1000, le=2100)
    author: Person


class Library(BaseModel):
    books: list[Book] = Field(min_length=1, max_length=2)


class OptionalNote(BaseModel):
    title: str = Short
    note: str | None = Field(default=None, max_length=24)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    pet: Cat | Dog


class Email(BaseModel):
    email: str = Field(pattern=r"^[a-z]{1,8}@[a-z]{1,8}\.com$")


class Meeting(BaseModel):
    date: str = Field(pattern=r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]$")
    topic: str = Short


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Polygon(BaseModel):
    points: list[Point] = Field(min_length=3, max_length=4)


class Recipe(BaseModel):
    dish: str = Short
    ingredients: list[Word] = Field(min_length=2, max_length=3)
    minutes: int = Field(ge=1, le=240)


class Flags(BaseModel):
    a: bool
    b: bool
    c: bool


class Product(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    price: float = Field(ge=0.0, le=1000.0)
    in_stock: bool


class Range(BaseModel):
    low: int = Field(ge=0, le=10)
    high: int = Field(ge=10, le=20)
    label: str | None = Field(default=None, max_length=12)


class Answer(BaseModel):
    answer: int | str = Field(union_mode="left_to_right")


SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (Person, "Invent a person."),
    (City, "Describe the city of Paris."),
    (PersonWithAddress, "Invent a person with an address."),
    (Tags, "Give tags for a post about cooking."),
    (Scores, "Give some test scores."),
    (Paint, "Pick a paint colour."),
    (Sentiment, "Classify: I love this movie."),
    (Weather, "What is the weather in Oslo?"),
    (Book, "Describe a famous book."),
    (Library, "List a book in a library."),
    (OptionalNote, "Write a note title."),
    (Pet, "Describe a pet."),
    (Email, "Give an email address."),
    (Meeting, "Schedule a meeting."),
    (Polygon, "Give a triangle."),
    (Recipe, "Give a short recipe."),
    (Flags, "Set three flags."),
    (Product, "Describe a product."),
    (Answer, "What is 2 + 2?"),
    (Point, "Give a point."),
    (Range, "Give a range of numbers."),
]
