"""Regenerate ``specdec/distill/prompts.jsonl``, the prompt set for self-distilling an EAGLE draft head.

Run ``python -m specdec.distill.make_prompts``. Every text is composed here from templates written for this project
crossed with filler lists, using seeded ``random.Random`` instances, so the output is byte-identical on every run and
needs no network. Candidates that repeat an earlier prompt (after case/whitespace normalisation), or that equal or
reuse a sentence of a benchmark prompt in ``bench/prompts/``, are rejected: distilling on the benchmark prompts would
inflate the acceptance rates the benchmarks measure.
"""

import json
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from specdec.distill.prompts import CATEGORIES, LONG_CONTEXT

SEED = 20250611
PER_CATEGORY = 550
HELDOUT_PER_CATEGORY = 30
# Long prompts cost a data run far more than the others (a prefill of 650-2 000 tokens each), so fewer of them.
PER_CATEGORY_OVERRIDE = {LONG_CONTEXT: 430}
OUTPUT_PATH = Path(__file__).with_name("prompts.jsonl")
BENCH_DIR = Path(__file__).resolve().parents[2] / "bench" / "prompts"
BENCH_FILES = ("load.jsonl", "colocated.jsonl")
# The model is small: prompts past this many words (summarise passages are the longest) are redrawn; a long-context
# prompt is redrawn outside its own range instead.
MAX_USER_WORDS = 230
LONG_CONTEXT_WORDS = (300, 1800)  # source files run ~2.3 tokens a word, prose ~1.3

Message = dict[str, str]

# --------------------------------------------------------------------------------------------------------------------
# Filler pools. A template slot ``{name}`` draws from POOLS["name"]; ``{name2}`` draws a second, different value.

_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]

_SCIENCE = [
    "photosynthesis",
    "plate tectonics",
    "the water cycle",
    "ocean tides",
    "static electricity",
    "the greenhouse effect",
    "nuclear fusion in stars",
    "the Doppler effect",
    "magnetism",
    "evaporation",
    "the phases of the Moon",
    "buoyancy",
    "friction",
    "sound waves",
    "the Northern Lights",
    "erosion",
    "the carbon cycle",
    "volcanic eruptions",
    "lightning",
    "the seasons",
    "gravity",
    "rainbows",
    "echoes",
    "tsunamis",
    "fermentation",
    "crystals",
    "solar eclipses",
    "osmosis",
    "air pressure",
    "fossils",
]

_TERMS = [
    "a peninsula",
    "an isotope",
    "a metaphor",
    "inflation",
    "a monsoon",
    "an estuary",
    "a sonnet",
    "an alloy",
    "a glacier",
    "a democracy",
    "an enzyme",
    "a comet",
    "a tariff",
    "a vaccine",
    "a haiku",
    "an archipelago",
    "a catalyst",
    "a fjord",
    "a palindrome",
    "a budget deficit",
    "an oxymoron",
    "a pulsar",
    "a delta",
    "a mammal",
    "an atoll",
    "a constitution",
    "biodiversity",
    "a solstice",
    "a watershed",
    "a prism",
    "an equinox",
    "a savanna",
    "a renewable resource",
    "a semiconductor",
    "a neuron",
    "a tundra",
]

_EVENTS = [
    "a surprise birthday party",
    "a team lunch",
    "a neighbourhood clean-up",
    "a board game night",
    "a school science fair",
    "a charity bake sale",
    "a family reunion",
    "a book club meeting",
    "a retirement party",
    "a garden party",
    "a small wedding",
    "a movie night",
    "a picnic in the park",
    "a housewarming",
    "a hiking day with colleagues",
    "a children's art workshop",
    "a community quiz night",
]

POOLS: dict[str, Sequence[str] | Callable[[random.Random], str]] = {
    "name": [
        "Amara",
        "Ben",
        "Chiara",
        "Dmitri",
        "Elif",
        "Farid",
        "Grace",
        "Hiro",
        "Ines",
        "Jonas",
        "Kavya",
        "Leon",
        "Maya",
        "Nikos",
        "Olga",
        "Pablo",
        "Quinn",
        "Rania",
        "Sven",
        "Tendai",
        "Uma",
        "Victor",
        "Wen",
        "Ximena",
        "Yusuf",
        "Zofia",
        "Aiko",
        "Bruno",
        "Carmen",
        "Daniel",
        "Esther",
        "Felix",
        "Gulnara",
        "Hassan",
        "Isla",
        "Joaquin",
        "Keiko",
        "Lars",
        "Mei",
        "Nadia",
        "Oscar",
        "Priya",
        "Rafael",
        "Sofia",
        "Tomas",
        "Valentina",
        "Wanjiru",
        "Yara",
        "Arjun",
        "Beatriz",
        "Ciaran",
        "Dalia",
        "Emeka",
        "Freya",
        "Gabriel",
        "Helga",
        "Ivan",
    ],
    "city": [
        "Lisbon",
        "Kyoto",
        "Nairobi",
        "Montreal",
        "Edinburgh",
        "Valparaiso",
        "Hanoi",
        "Krakow",
        "Marrakesh",
        "Melbourne",
        "Reykjavik",
        "Seville",
        "Tbilisi",
        "Cape Town",
        "Oaxaca",
        "Bergen",
        "Ljubljana",
        "Porto",
        "Istanbul",
        "Singapore",
        "Vancouver",
        "Bologna",
        "Tallinn",
        "Cusco",
        "Seoul",
        "Dublin",
        "Dubrovnik",
        "Salzburg",
        "Chiang Mai",
        "Copenhagen",
        "Quebec City",
        "Zanzibar",
        "Granada",
        "Wellington",
        "Budapest",
    ],
    "country": [
        "Portugal",
        "Japan",
        "Kenya",
        "Canada",
        "Chile",
        "Vietnam",
        "Poland",
        "Morocco",
        "Iceland",
        "Georgia",
        "Mexico",
        "Norway",
        "Slovenia",
        "Turkey",
        "Peru",
        "Ireland",
        "Croatia",
        "Austria",
        "Thailand",
        "Denmark",
        "New Zealand",
        "Hungary",
        "Ghana",
        "Argentina",
        "Finland",
        "Egypt",
        "India",
        "Brazil",
        "Greece",
        "Estonia",
    ],
    "season": ["early spring", "late spring", "midsummer", "early autumn", "late autumn", "the middle of winter"],
    "dish": [
        "lentil soup",
        "vegetable curry",
        "mushroom risotto",
        "banana bread",
        "shakshuka",
        "fried rice",
        "pumpkin soup",
        "chickpea stew",
        "potato gratin",
        "apple crumble",
        "tomato pasta sauce",
        "omelette",
        "flatbread",
        "pancakes",
        "bean chilli",
        "pad thai",
        "ratatouille",
        "carrot cake",
        "gazpacho",
        "dal",
        "fish tacos",
        "spinach pie",
        "miso soup",
        "lemon tart",
        "stir-fried noodles",
        "baked falafel",
    ],
    "ingredient": [
        "fresh basil",
        "eggs",
        "butter",
        "coconut milk",
        "brown rice",
        "feta cheese",
        "garlic",
        "ginger",
        "chickpeas",
        "spinach",
        "oat milk",
        "cumin",
        "honey",
        "lemons",
        "mushrooms",
        "sweet potatoes",
        "tofu",
        "yoghurt",
        "cinnamon",
        "parsley",
        "red lentils",
        "olive oil",
        "cornflour",
        "sesame seeds",
    ],
    "hobby": [
        "watercolour painting",
        "rock climbing",
        "bird watching",
        "knitting",
        "chess",
        "pottery",
        "gardening",
        "photography",
        "baking bread",
        "learning the guitar",
        "calligraphy",
        "cycling",
        "origami",
        "woodworking",
        "journaling",
        "swimming",
        "astronomy",
        "salsa dancing",
        "sketching",
        "kayaking",
        "embroidery",
        "archery",
        "playing the piano",
        "trail running",
        "beekeeping",
        "juggling",
        "model railways",
        "stand-up paddling",
    ],
    "science": _SCIENCE,
    "history": [
        "the invention of the printing press",
        "the building of the pyramids at Giza",
        "the first Moon landing",
        "the Silk Road",
        "the Industrial Revolution",
        "the fall of the Berlin Wall",
        "the Renaissance",
        "the voyages of Zheng He",
        "the Roman aqueducts",
        "the invention of the telephone",
        "the Black Death",
        "the Meiji Restoration",
        "the Great Fire of London",
        "the first powered flight",
        "the Inca road system",
        "the building of the Panama Canal",
        "the Viking settlements in Iceland",
        "the Mali Empire",
        "the invention of paper in China",
        "the discovery of penicillin",
        "the first transatlantic telegraph",
    ],
    "tech": [
        "Wi-Fi",
        "public-key encryption",
        "cloud storage",
        "GPS navigation",
        "QR codes",
        "solid-state drives",
        "compilers",
        "DNS",
        "two-factor authentication",
        "barcodes",
        "touchscreens",
        "email spam filters",
        "Bluetooth",
        "fibre-optic cables",
        "password managers",
        "search engines",
        "video compression",
        "electric car batteries",
        "noise-cancelling headphones",
        "3D printers",
        "web browsers",
        "USB-C",
        "virtual private networks",
        "recommendation systems",
        "weather satellites",
        "contactless payments",
    ],
    "situation": [
        "leaving a group chat without offending anyone",
        "arriving late to a dinner party",
        "declining a wedding invitation",
        "asking a neighbour to turn their music down",
        "splitting the bill at a restaurant",
        "reminding a friend about money they owe me",
        "turning down a second date",
        "telling a colleague they have food on their face",
        "asking guests to take off their shoes",
        "replying to a message I ignored for weeks",
        "giving feedback on a friend's business idea",
        "asking my landlord to fix a leaking tap",
        "leaving a party early",
        "saying no to extra work from my manager",
        "joining a conversation at a networking event",
        "correcting someone who mispronounces my name",
        "asking a coworker to stop interrupting me",
    ],
    "goal": [
        "keep a tidy desk",
        "wake up earlier",
        "read more books",
        "save money on groceries",
        "learn to cook",
        "spend less time on my phone",
        "keep in touch with old friends",
        "learn a new language",
        "organise my wardrobe",
        "stick to a budget",
        "plan meals for the week",
        "keep a journal",
        "be more punctual",
        "get better at public speaking",
        "make my commute less stressful",
        "take better notes in meetings",
        "remember people's names",
        "keep my inbox under control",
    ],
    "event": _EVENTS,
    "animal": [
        "octopus",
        "honeybee",
        "snow leopard",
        "axolotl",
        "emperor penguin",
        "platypus",
        "elephant",
        "crow",
        "sea otter",
        "chameleon",
        "bat",
        "hummingbird",
        "dolphin",
        "tardigrade",
        "giraffe",
        "red panda",
        "wolf",
        "starfish",
        "owl",
        "camel",
        "koala",
        "jellyfish",
        "beaver",
        "peacock",
        "hedgehog",
        "salmon",
    ],
    "object": [
        "a wooden chair",
        "a bicycle helmet",
        "a kettle",
        "a backpack",
        "a desk lamp",
        "a pair of boots",
        "a notebook",
        "a frying pan",
        "an umbrella",
        "a coffee grinder",
        "a winter coat",
        "a tent",
        "a water bottle",
        "a sofa",
        "a set of kitchen knives",
        "a laptop stand",
        "a rug",
        "a suitcase",
    ],
    "lang": ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C#", "Ruby", "Kotlin", "PHP", "Swift"],
    "script": ["Python", "JavaScript", "Go", "Rust", "Ruby", "Kotlin"],
    "task": [
        "returns the second largest number in a list",
        "counts how many times each word appears in a string",
        "checks whether two strings are anagrams of each other",
        "converts a temperature from Celsius to Fahrenheit",
        "removes duplicate values from a list while keeping their order",
        "returns the n-th Fibonacci number",
        "splits a list into chunks of a given size",
        "finds the longest word in a sentence",
        "checks whether a year is a leap year",
        "capitalises the first letter of every word in a string",
        "returns the sum of the digits of an integer",
        "merges two sorted lists into one sorted list",
        "rotates a list to the right by k positions",
        "converts a number of seconds into hours, minutes and seconds",
        "checks whether a string contains balanced brackets",
        "returns the most common character in a string",
        "computes the median of a list of numbers",
        "validates that a string looks like an email address",
        "converts a Roman numeral to an integer",
        "returns all the prime numbers below a limit",
        "computes the greatest common divisor of two integers",
        "truncates a string to a maximum length and adds an ellipsis",
        "groups a list of words by their first letter",
        "returns the intersection of two lists without duplicates",
        "reverses the order of words in a sentence",
        "checks whether a number is a perfect square",
        "converts a string to snake_case",
        "computes the running average of a list",
        "returns the index of the first repeated element in a list",
        "counts the vowels and consonants in a word",
    ],
    "sqltask": [
        "lists every customer who has not placed an order",
        "counts the orders placed in each month of 2023",
        "finds the three most expensive products in each category",
        "returns the average salary per department, highest first",
        "deletes duplicate rows that share the same email address",
        "shows the total revenue per country",
        "finds employees who earn more than their manager",
        "returns the five most recent comments with their author names",
        "lists products that have never been reviewed",
        "calculates each student's average grade",
        "finds the day with the most sign-ups",
        "updates the price of every item in the category 'garden' by ten percent",
    ],
    "bashtask": [
        "renames every .jpeg file in a folder to .jpg",
        "prints the ten most frequent words in a text file",
        "deletes log files older than seven days",
        "backs up a directory into a dated tar.gz archive",
        "checks whether a website responds and prints the HTTP status code",
        "counts how many files of each extension are in a directory",
        "prints the disk usage of each subfolder sorted by size",
        "watches a file and prints new lines as they are added",
        "converts every .png image in a folder to .webp",
        "prints the lines of a CSV file where the third column is empty",
        "creates a folder for each day of the current month",
        "kills a process by name after asking for confirmation",
    ],
    "concept": [
        "recursion",
        "closures",
        "immutability",
        "dependency injection",
        "memoisation",
        "a hash map",
        "a linked list",
        "garbage collection",
        "an API",
        "unit testing",
        "version control",
        "a REST endpoint",
        "big-O notation",
        "a race condition",
        "a deadlock",
        "type inference",
        "an iterator",
        "a database index",
        "a foreign key",
        "continuous integration",
        "a mutex",
        "lazy evaluation",
        "a binary tree",
        "polymorphism",
        "a queue",
        "caching",
        "a stack overflow",
        "string interpolation",
        "an event loop",
        "a pure function",
    ],
    "topic": [
        "remote work",
        "electric cars",
        "city gardens",
        "public libraries",
        "learning to code",
        "minimalism",
        "online shopping",
        "street food",
        "train travel",
        "renewable energy",
        "volunteering",
        "podcasts",
        "board games",
        "tiny houses",
        "learning an instrument",
        "recycling",
        "four-day work weeks",
        "camping",
        "keeping chickens",
        "living abroad",
        "open-plan offices",
        "reading on paper",
        "studying at night",
        "cooking at home",
        "working in a café",
        "owning a dog",
        "shared flats",
        "cycling to work",
    ],
    "choice": [
        "buying a used car",
        "living in the countryside",
        "learning online",
        "owning a cat",
        "working freelance",
        "studying abroad",
        "using a standing desk",
        "taking a gap year",
        "renting a bike in a big city",
        "having a vegetable garden",
        "travelling alone",
        "working night shifts",
        "living near the sea",
        "switching to a paper planner",
        "buying an e-reader",
        "joining a gym",
        "moving to a smaller flat",
    ],
    "place_kind": ["museum", "bakery", "bookshop", "café", "hostel", "community garden", "bicycle repair shop"],
    "n": lambda rng: rng.choice(_WORDS[3:11]),
    "num": lambda rng: str(rng.choice([3, 4, 5, 6, 7, 8, 10, 12])),
    "a": lambda rng: str(rng.randint(2, 19)),
    "b": lambda rng: str(rng.randint(3, 29)),
    "c": lambda rng: str(rng.randint(21, 480)),
    "d": lambda rng: str(rng.randint(120, 2400)),
    "pct": lambda rng: str(rng.choice([5, 8, 10, 12, 15, 20, 25, 30, 35, 40, 60, 75])),
    "price": lambda rng: f"{rng.randint(3, 95)}.{rng.choice(['00', '50', '25', '75', '99', '40'])}",
    "walk_km": lambda rng: str(rng.randint(60, 160)),
    "ride_km": lambda rng: str(rng.choice([100, 120, 150, 160, 200, 250, 300])),
    "km": lambda rng: str(rng.randint(3, 900)),
    "dice": lambda rng: str(rng.randint(2, 12)),
    "edition": ["third", "fifth", "seventh", "tenth", "twelfth", "fifteenth", "twentieth", "twenty-fifth"],
    "hours": lambda rng: str(rng.randint(2, 11)),
    "minutes": lambda rng: str(rng.choice([10, 15, 20, 25, 30, 40, 45, 50])),
    "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "month": [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ],
    "year": lambda rng: str(rng.randint(1998, 2024)),
    "shop_item": [
        "notebooks",
        "apples",
        "light bulbs",
        "concert tickets",
        "bus passes",
        "flower pots",
        "tennis balls",
        "jars of jam",
        "bags of flour",
        "paintbrushes",
        "candles",
        "loaves of bread",
        "tins of paint",
    ],
    "unit_pair": [
        "kilometres into miles",
        "miles into kilometres",
        "kilograms into pounds",
        "pounds into kilograms",
        "litres into millilitres",
        "degrees Celsius into degrees Fahrenheit",
        "hours into seconds",
        "centimetres into inches",
        "square metres into square feet",
        "grams into ounces",
        "days into hours",
        "metres per second into kilometres per hour",
        "cups of flour into grams",
        "gallons into litres",
    ],
    "maths_concept": [
        "prime numbers",
        "fractions",
        "negative numbers",
        "the order of operations",
        "percentages",
        "ratios",
        "probability",
        "the area of a circle",
        "averages",
        "square roots",
        "long division",
        "exponents",
        "the mean, median and mode",
        "simple interest",
        "angles in a triangle",
        "the number pi",
        "place value",
        "rounding",
        "scientific notation",
        "the slope of a line",
        "factorials",
        "standard deviation",
    ],
    "term": _TERMS,
    "pair": [
        "a lake and a pond",
        "a frog and a toad",
        "a crocodile and an alligator",
        "an ocean and a sea",
        "a star and a planet",
        "a hurricane and a tornado",
        "weather forecasting and astrology",
        "a simile and a metaphor",
        "an element and a compound",
        "speed and velocity",
        "mass and weight",
        "a hill and a mountain",
        "a moth and a butterfly",
        "a rabbit and a hare",
        "a dialect and a language",
        "a meteor and a meteorite",
        "a republic and a monarchy",
        "a novel and a novella",
        "an atom and a molecule",
        "a turtle and a tortoise",
        "jam and jelly",
        "a violin and a viola",
        "sleet and hail",
        "RAM and storage",
        "a debit card and a credit card",
        "a museum and a gallery",
        "a bay and a gulf",
        "a cyclone and a typhoon",
    ],
    "abbr": [
        "NASA",
        "UNESCO",
        "HTML",
        "GPS",
        "DNA",
        "ATM",
        "PDF",
        "UV",
        "CPU",
        "LED",
        "FAQ",
        "RSVP",
        "ISBN",
        "URL",
        "Wi-Fi",
        "SCUBA",
        "LASER",
        "RADAR",
        "USB",
        "WHO",
    ],
    "inventor_item": [
        "the light bulb",
        "the telephone",
        "the World Wide Web",
        "the printing press",
        "dynamite",
        "the radio",
        "the steam engine",
        "the bicycle",
        "the periodic table",
        "the theory of general relativity",
        "the polio vaccine",
        "the ballpoint pen",
        "the first computer programme",
        "the jet engine",
    ],
}

# --------------------------------------------------------------------------------------------------------------------
# Templates. One string per template; a tuple in a multi-turn scenario lists alternatives for that turn.

CHAT_TEMPLATES = [
    "Explain {science} in simple terms.",
    "Can you explain {science} as if I were ten years old?",
    "What causes {science}? Keep it short.",
    "Give me a short, clear explanation of {science} with one everyday example.",
    "Tell me the story of {history} in a few paragraphs.",
    "Why was {history} so important?",
    "What would a student need to know about {history} for a short presentation?",
    "How does {tech} work, in plain language?",
    "What is the main idea behind {tech}? Explain it without jargon.",
    "My grandmother asked me how {tech} works. How could I explain it to her?",
    "What is the polite way to handle {situation}?",
    "I need advice on {situation}. What should I say?",
    "Is there a graceful way to deal with {situation}?",
    "I'm visiting {city} in {season}. What should I keep in mind?",
    "What is a good way to spend two days in {city} on a modest budget?",
    "I'm travelling to {country} for the first time. What local customs should I know about?",
    "How should I plan a week-long trip to {country} by train and bus?",
    "How do I make {dish} at home without special equipment?",
    "What can I use instead of {ingredient} when making {dish}?",
    "I have {ingredient} and {ingredient2} in the fridge. What could I cook tonight?",
    "How do I store {ingredient} so it stays fresh longer?",
    "I want to get into {hobby}. Where should a beginner start?",
    "How much time a week does it take to get decent at {hobby}?",
    "What mistakes do beginners usually make with {hobby}?",
    "I'm trying to {goal}. Do you have any practical advice?",
    "What is a realistic plan to {goal} over the next month?",
    "Tell me something surprising about the {animal}.",
    "How does the {animal} survive in the wild?",
    "My friend {name} is starting {hobby}. What small gift would be useful?",
    "Write a short birthday message for my colleague {name}, who loves {hobby}.",
    "What should I look for when buying {object}?",
    "How do I clean and look after {object} so it lasts for years?",
    "Help me write a friendly note inviting my neighbours to {event}.",
    "What are the first steps in organising {event}?",
    "Suggest a name for a small {place_kind} in {city}.",
    "Write a short poem about {hobby} on a rainy afternoon.",
    "Write a four-line poem about the {animal}.",
    "What is the best way to start a conversation with someone who is into {hobby}?",
    "I feel unmotivated on {day} mornings. How can I make them easier?",
    "What are the arguments for and against {topic}? Keep it balanced.",
]

CODE_SNIPPETS_PY_BUGGY = [
    "def count_positive(nums):\n    count = 0\n    for n in nums:\n        if n > 0:\n            count =+ 1\n"
    "    return count",
    "def join_names(names):\n    result = ''\n    for i in range(len(names) - 1):\n        result += names[i] + ', '\n"
    "    return result",
    "def find_max(values):\n    best = 0\n    for x in values:\n        if x > best:\n            best = x\n"
    "    return best",
    "def is_even(n):\n    if n % 2 == 1:\n        return True\n    return False",
    "def add_item(item, basket=[]):\n    basket.append(item)\n    return basket",
    "def factorial(n):\n    result = 0\n    for i in range(1, n + 1):\n        result *= i\n    return result",
    "def reverse_string(s):\n    out = ''\n    for ch in s:\n        out = out + ch\n    return out",
    "def percent(part, whole):\n    return part // whole * 100",
    "def first_word(sentence):\n    return sentence.split(' ')[1]",
    "def read_lines(path):\n    f = open(path)\n    lines = f.readlines\n    f.close()\n    return lines",
    "def middle(items):\n    return items[len(items) / 2]",
    "def count_words(text):\n    tally = {}\n    for word in text.split():\n        tally[word] += 1\n    return tally",
    "def safe_divide(a, b):\n    try:\n        return a / b\n    except:\n        print('error')",
    "def remove_odds(nums):\n    for n in nums:\n        if n % 2:\n            nums.remove(n)\n    return nums",
]

CODE_SNIPPETS_PY = [
    "def pairs(xs):\n    return [(a, b) for i, a in enumerate(xs) for b in xs[i + 1:]]",
    "def chunk(seq, size):\n    return [seq[i:i + size] for i in range(0, len(seq), size)]",
    "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))",
    "from collections import Counter\n\ndef top_letters(text, k=3):\n"
    "    letters = [c for c in text.lower() if c.isalpha()]\n    return Counter(letters).most_common(k)",
    "def running_max(values):\n    out, best = [], float('-inf')\n    for x in values:\n        best = max(best, x)\n"
    "        out.append(best)\n    return out",
    "def invert(d):\n    return {v: k for k, v in d.items()}",
    "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))",
    "def initials(full_name):\n    return ''.join(part[0].upper() for part in full_name.split())",
    "def parse_pairs(line):\n    return dict(item.split('=') for item in line.split(';') if item)",
    "import os\n\ndef biggest_file(folder):\n    paths = [os.path.join(folder, n) for n in os.listdir(folder)]\n"
    "    files = [p for p in paths if os.path.isfile(p)]\n    return max(files, key=os.path.getsize)",
]

CODE_SNIPPETS_JS = [
    "function sumPrices(items) {\n  let total = 0;\n  for (const item of items) total += item.price * item.qty;\n"
    "  return total;\n}",
    "const unique = (arr) => [...new Set(arr)];",
    "function greet(user) {\n  if (user.name == undefined) return 'Hello, guest';\n  return 'Hello, ' + user.name;\n}",
    "function countBy(arr, key) {\n  return arr.reduce((acc, x) => {\n    acc[x[key]] = (acc[x[key]] || 0) + 1;\n"
    "    return acc;\n  }, {});\n}",
    "for (var i = 0; i < 3; i++) {\n  setTimeout(function () { console.log(i); }, 100);\n}",
    "function titleCase(s) {\n  return s.split(' ').map(w => w[0].toUpperCase() + w.slice(1)).join(' ');\n}",
]

CODE_SNIPPETS_SQL = [
    "SELECT city, COUNT(*) AS n\nFROM users\nWHERE created_at >= '2024-01-01'\nGROUP BY city\nHAVING COUNT(*) > 10\n"
    "ORDER BY n DESC;",
    "SELECT p.title, MAX(r.stars) AS best\nFROM products p\nLEFT JOIN reviews r ON r.product_id = p.id\n"
    "GROUP BY p.title;",
    "UPDATE accounts\nSET balance = balance - 20\nWHERE id = 7;",
    "SELECT name FROM members\nWHERE id NOT IN (SELECT member_id FROM loans WHERE returned = 0);",
]

CODE_SNIPPETS_BASH = [
    'for f in *.csv; do\n  wc -l "$f"\ndone | sort -n',
    "grep -rl 'TODO' src/ | xargs sed -i 's/TODO/FIXME/g'",
    "find . -name '*.tmp' -mtime +3 -delete",
    "du -sh */ | sort -h | tail -n 5",
    "cat access.log | awk '{print $1}' | sort | uniq -c | sort -rn | head",
]

POOLS["py_buggy"] = CODE_SNIPPETS_PY_BUGGY
POOLS["py_snippet"] = CODE_SNIPPETS_PY
POOLS["js_snippet"] = CODE_SNIPPETS_JS
POOLS["sql_snippet"] = CODE_SNIPPETS_SQL
POOLS["bash_snippet"] = CODE_SNIPPETS_BASH

CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Write a {lang} function that {task}, and include two example calls.",
    "Show me how to write a {lang} function that {task}. Explain each step briefly.",
    "I need a small {script} helper that {task}. Keep it readable.",
    "Write a function in {lang} that {task}, and say what its time complexity is.",
    "Write a {lang} function that {task}, with a short comment on any edge cases.",
    "Write unit tests for a {script} function that {task}.",
    "Write a SQL query that {sqltask}. Assume reasonable table and column names.",
    "Using tables orders(id, customer_id, total, placed_at) and customers(id, name, country), write a query that "
    "{sqltask}.",
    "Write a bash script that {bashtask}.",
    "Give me a shell command that {bashtask}, and explain its parts.",
    "Explain {concept} to a junior developer, with a short {script} example.",
    "What is {concept}, and when should I use it?",
    "Compare {concept} and {concept2} in a few sentences.",
    "This Python function has a bug. Find it and fix it:\n\n```python\n{py_buggy}\n```",
    "Why does this code not behave as expected? Show a corrected version.\n\n```python\n{py_buggy}\n```",
    "Explain line by line what this Python code does:\n\n```python\n{py_snippet}\n```",
    "Refactor this Python code to make it easier to read, and say what you changed:\n\n```python\n{py_snippet}\n```",
    "Translate this Python code into {script}:\n\n```python\n{py_snippet}\n```",
    "Write three pytest tests for this function:\n\n```python\n{py_snippet}\n```",
    "Explain what this JavaScript does and point out anything surprising:\n\n```javascript\n{js_snippet}\n```",
    "Rewrite this JavaScript in modern TypeScript with types:\n\n```javascript\n{js_snippet}\n```",
    "What does this SQL query return? Describe it in plain English.\n\n```sql\n{sql_snippet}\n```",
    "Explain each part of this shell pipeline:\n\n```bash\n{bash_snippet}\n```",
    "Rewrite this shell command as a short Python script:\n\n```bash\n{bash_snippet}\n```",
    "Write a {lang} program that reads numbers from standard input and {task_tail}.",
    "In {lang}, what is a common mistake people make when writing a function that {task}?",
]
POOLS["task_tail"] = [
    "prints their average",
    "prints the largest one",
    "prints them sorted",
    "prints how many are negative",
    "prints their sum and product",
    "prints only the even ones",
    "prints the difference between max and min",
]

MATHS_TEMPLATES = [
    "{name} buys {a} {shop_item} at {price} each. How much does {name} spend in total?",
    "A train travels {km} km in {hours} hours. What is its average speed in km per hour?",
    "A jacket costs {price} and is reduced by {pct}%. What is the new price?",
    "What is {pct}% of {d}? Show your working.",
    "{name} has {c} marbles and gives {pct}% of them to {name2}. How many does {name} have left?",
    "Convert {km} kilometres into miles and explain the conversion factor.",
    "How do I convert {unit_pair}? Give one worked example.",
    "Solve for x: {a}x + {b} = {c}.",
    "Solve for x and check your answer: {a}(x - {b}) = {c}.",
    "If {a} workers can paint a fence in {hours} hours, how long would it take {b} workers at the same rate?",
    "A recipe for {a} people needs {c} grams of flour. How much flour is needed for {b} people?",
    "A rectangle is {a} cm wide and {b} cm long. What are its area and perimeter?",
    "What is the average of {a}, {b}, {c} and {d}?",
    "Explain {maths_concept} with a simple example.",
    "How would you teach {maths_concept} to a twelve-year-old?",
    "What is a common mistake students make with {maths_concept}?",
    "At a market, {shop_item} cost {price} each, or {a} for {price2}. Which is the better deal?",
    "{name} saves {c} every month. How long will it take to save {d}?",
    "A car uses {a} litres of fuel per 100 km. How much fuel is needed for a {km} km trip?",
    "The price of a ticket rose from {b} to {c}. By what percentage did it increase?",
    "What is {c} divided by {a}, to two decimal places?",
    "Is {d} divisible by {a}? Explain how you can tell.",
    "A tank holds {d} litres and drains at {b} litres per minute. How long until it is empty?",
    "{name} reads {b} pages a day. How many days to finish a book of {c} pages?",
    "If a bike wheel has a diameter of {b} inches, how far does it travel in {a} full turns?",
    "Find two numbers whose sum is {c} and whose difference is {a}.",
    "What is the probability of rolling a total of {dice} with two fair six-sided dice?",
    "A class has {b} students and {pct}% of them walk to school. How many students is that?",
    "Simplify the fraction {c}/{d} and explain each step.",
    "How many minutes are there in {a} days and {hours} hours?",
    "A bank pays {a}% simple interest a year. How much interest does {d} earn in {hours} years?",
]

LISTS_TEMPLATES = [
    "List {n} ideas for {event}.",
    "Give me {n} tips to {goal}.",
    "What are {n} pros and {n2} cons of {choice}?",
    "List the pros and cons of {choice} in two short columns.",
    "Give me {n} steps to get started with {hobby}.",
    "Name {n} things a beginner needs for {hobby}.",
    "Suggest {n} dishes I could make with {ingredient}.",
    "List {n} things to do in {city} on a rainy day.",
    "Give me {n} facts about the {animal}.",
    "What are {n} questions I could ask at {event} to break the ice?",
    "List {n} common myths about {science} and explain why each is wrong.",
    "Give me a checklist of {n} things to pack for a trip to {country} in {season}.",
    "List {n} ways {tech} is used in everyday life.",
    "Suggest {n} names for a {place_kind} run by someone who loves {hobby}.",
    "Give me {n} conversation topics about {topic}.",
    "What are {n} arguments people make about {topic}?",
    "List {n} small daily habits that would help me {goal}.",
    "Give {n} examples of {concept} in real programs.",
    "Write a numbered list of {n} steps for making {dish}.",
    "Give me {n} ideas for a weekend project involving {hobby}.",
    "List {n} key events in {history}, in order.",
    "Name {n} things to check before buying {object}.",
    "List {n} ways to reuse {object} instead of throwing it away.",
    "Suggest {n} short blog post titles about {topic}.",
    "Give me {n} quiz questions about {science}, with answers.",
    "What are {n} good reasons to visit {city}?",
    "List {n} mistakes to avoid when {situation}.",
    "Give me {n} ways to make {dish} healthier.",
    "Make a list of {n} hobbies that pair well with {hobby}.",
]

# Short texts for the rewrite category: 1-4 sentences each, slots filled per prompt.
REWRITE_TEXTS = [
    "hey {name}, the meeting got moved to {day}. bring the slides if u can. thx",
    "The {place_kind} on the corner will close early on {day}. Staff are taking part in a training course.",
    "I am writing to tell you that your parcel has been delayed. It should arrive by {day}. We apologise for the wait.",
    "Our {event_bare} was a big success. More than {c} people came, and we raised enough for new school books.",
    "The new bus route starts in {month}. It will connect the station with the hospital and the university.",
    "{name} fixed the printer on the second floor. It was jammed with old envelopes, so please keep them out of it.",
    "me and {name} goes to the market every {day} and we buys {ingredient} and bread",
    "The report is late because two people were ill. We will send it next week. The numbers look good so far.",
    "Thank you for coming to the {event_bare}. We hope you had fun. Photos will be shared by email.",
    "The committee approved the plan. Work on the bike lanes will begin in {month}. Some roads will be closed.",
    "Please remember to water the plants on the balcony. The tomatoes need water every day when it is hot.",
    "I cant come to practise on {day} because my car broke down, sorry. can someone tell me what I missed",
    "The museum has a new exhibition about {history}. It opens on {day} and runs until the end of {month}.",
    "{name} baked a cake for the team. Everyone loved it. The secret, apparently, is {ingredient}.",
    "Due to maintenance, the lifts will be out of service on {day} morning. Please use the stairs.",
    "The kids planted sunflowers in the school garden. Some of them are already taller than the teacher.",
    "We are looking for volunteers to help with {event}. No experience is needed. Snacks will be provided.",
    "The app crashed when I tried to upload a photo. I restarted my phone, but it still does not work.",
    "{name} has been chosen as the new captain of the chess club after {a} years as a member.",
    "The heating engineer will visit on {day} between nine and twelve. Someone must be at home to let him in.",
    "Their going to the {place_kind} later, do you want to come with them or are you to busy",
    "The team finished the project two weeks early. The client was very happy with the result.",
    "Ticket prices will go up by {pct} percent in {month}. Season ticket holders are not affected.",
    "A fox got into the garden last night and knocked over the bins. There was rubbish everywhere this morning.",
    "Our flight to {city} was cancelled. The airline offered us a hotel and a seat on the next flight.",
    "{name} is learning {hobby}, practising every evening after dinner and getting better quickly.",
    "The library will start lending tools as well as books. You can borrow a drill for a week.",
    "Wear comfortable shoes tomorrow. We will walk about {a} kilometres through the old town of {city}.",
    "The water will be turned off on {day} from ten until two. Fill a few bottles in advance.",
    "I loved the {dish} you made. Could you send me the recipe? I want to cook it for my parents.",
]

REWRITE_INSTRUCTIONS = [
    "Rewrite this in a formal tone",
    "Make this sound more casual and friendly",
    "Shorten this to a single sentence",
    "Rewrite this in the passive voice where it makes sense",
    "Fix the grammar and spelling in this text",
    "Turn this into a short bulleted list",
    "Rewrite this for a notice board in a block of flats",
    "Make this more polite",
    "Rewrite this so a seven-year-old could understand it",
    "Rewrite this as a text message of under twenty words",
    "Rewrite this in the future tense",
    "Make this sound more enthusiastic",
    "Rewrite this as a short announcement for a newsletter",
    "Rewrite this in the first person plural",
    "Rewrite this as a headline and one supporting sentence",
    "Rewrite this more concisely without losing any information",
    "Make this sound more professional, as if written to a customer",
    "Rewrite this from {name2}'s point of view",
    "Rewrite this in the style of a weather forecast",
    "Rewrite this as an email with a subject line",
    "Paraphrase this using different words",
    "Rewrite this as a tweet with one hashtag",
    "Rewrite this so that it sounds calmer and less alarming",
    "Rewrite this as a question-and-answer pair",
    "Rewrite this as two short sentences with simple words",
    "Make this sound like a friendly reminder",
    "Rewrite this in a neutral, factual tone",
]

REWRITE_FRAMES = [
    "{instruction}:\n\n{text}",
    "{instruction}.\n\n{text}",
    "{text}\n\n{instruction}.",
    "Here is a short text:\n\n{text}\n\n{instruction}, please.",
    "{instruction}. Keep the meaning the same.\n\n{text}",
]

# Passage families for the summarise category: ordered sentence templates; a passage keeps a random ordered subset.
PASSAGES: dict[str, list[str]] = {
    "town": [
        "Residents of {city} will vote in {month} on a proposal to turn the old railway yard into a public park.",
        "The site has been empty for almost {b} years and is currently fenced off.",
        "Supporters say the park would give families in the eastern districts their first large green space.",
        "The plan includes a playground, a community garden and a path for walkers and cyclists.",
        "Opponents worry about the cost, which the council estimates at around {d} thousand euros.",
        "Some shop owners would prefer the land to be used for housing or a market hall.",
        "A local architect, {name}, has offered to draw up a cheaper design at no charge.",
        "The council says that if the vote passes, work could start the following spring.",
        "Public meetings about the proposal will be held every {day} evening until the vote.",
        "Whatever the result, the council has promised to clean up the site by the end of the year.",
    ],
    "study": [
        "A team of researchers led by {name} spent {a} months studying how the {animal} finds food.",
        "They followed {c} individuals using small tracking devices and hidden cameras.",
        "The animals travelled much further each day than earlier estimates had suggested.",
        "Most of their feeding happened in the early morning, shortly after sunrise.",
        "The team was surprised to see that younger animals often copied the routes of older ones.",
        "This suggests that knowledge about good feeding places may be passed between generations.",
        "The researchers also noticed that the animals avoided areas near busy roads.",
        "They now plan to repeat the study in {season} to see whether the patterns change.",
        "The findings could help conservation groups decide which areas to protect first.",
        "The full results will be published in a journal later this year.",
    ],
    "company": [
        "{name} started a small {place_kind} in {city} in {year} with a loan from the family.",
        "In the first year, the business barely covered its rent.",
        "Things changed when a local newspaper wrote a short article about it.",
        "Within a few months, customers were queueing outside on {day} mornings.",
        "The business now employs {a} people and has opened a second branch.",
        "{name} says the secret is listening carefully to what regular customers ask for.",
        "The founder still works behind the counter at least twice a week.",
        "Rising energy prices have been a challenge, and some prices have gone up by {pct} percent.",
        "Next year, the business hopes to start offering evening workshops for beginners.",
        "The advice for anyone starting out is to begin small and keep costs low.",
    ],
    "history": [
        "Historians still debate many details of {history}.",
        "What is clear is that it changed daily life for a great many ordinary people.",
        "Before it, news and ideas travelled slowly and often unreliably.",
        "Afterwards, merchants, scholars and officials could share information far more quickly.",
        "Not everyone welcomed the change, and some rulers tried to limit its effects.",
        "Surviving letters show that people at the time were both excited and anxious.",
        "Its influence spread unevenly, reaching some regions decades before others.",
        "Many modern institutions can trace part of their origins back to this period.",
        "Today, museums in several countries hold objects connected to it.",
        "Teachers often use it as an example of how one change can set off many others.",
    ],
    "club": [
        "The {city} amateur cycling club has just finished its most successful season so far.",
        "Membership grew from {b} to {c} riders over the year.",
        "The club organised weekly rides on {day} mornings for every level of fitness.",
        "A new beginners' group, led by {name}, proved especially popular.",
        "Several members completed their first long-distance ride of {ride_km} kilometres.",
        "The club also raised money for a local children's hospital.",
        "Not everything went smoothly: two rides were cancelled because of storms.",
        "The committee plans to buy a few spare bikes so that newcomers can try the sport.",
        "Next season will begin in {month} with an open day for anyone interested.",
        "The club thanks its volunteers, without whom none of this would have been possible.",
    ],
    "trip": [
        "Last {month}, {name} and two friends spent a week walking across the hills near {city}.",
        "They carried everything they needed in their backpacks and slept in small guesthouses.",
        "The first two days were sunny, and they covered more ground than they had planned.",
        "On the third day, heavy rain forced them to wait in a village café until the afternoon.",
        "A farmer they met there showed them a shortcut through the valley.",
        "The views from the highest pass were the highlight of the trip.",
        "By the end of the week, they had walked about {walk_km} kilometres.",
        "{name} says the hardest part was not the walking but getting up early every morning.",
        "They are already planning a similar trip in {country} next year.",
        "Their advice to others is to pack light and to always carry a rain jacket.",
    ],
    "product": [
        "A company in {city} has released a new kind of {object_bare} designed to last for decades.",
        "Instead of glue, every part is held together with screws so it can be repaired.",
        "Spare parts are sold separately and can be ordered online.",
        "The company says most repairs take less than {minutes} minutes with basic tools.",
        "Early reviews praise the build quality but say the price is high.",
        "It costs roughly {pct} percent more than similar products from other brands.",
        "The founders argue that customers will save money over the years.",
        "Environmental groups have welcomed the idea of products built to be repaired.",
        "The company plans to publish repair guides for all of its products.",
        "If sales go well, it hopes to expand into other countries next year.",
    ],
    "science": [
        "{science_cap} is something most people have noticed without thinking much about it.",
        "Scientists have studied it carefully for a long time.",
        "At its heart is a simple idea that can be demonstrated with everyday objects.",
        "Teachers often show it to students with a short experiment in the classroom.",
        "The effect can be small in daily life but very large on the scale of the planet.",
        "Understanding it has helped engineers design safer buildings and machines.",
        "It also helps explain several patterns that farmers and sailors noticed centuries ago.",
        "There are still open questions, especially about how it behaves in extreme conditions.",
        "New instruments are allowing researchers to measure it more precisely than ever.",
        "Most experts agree that it will remain an important topic for years to come.",
    ],
    "festival": [
        "The annual food festival in {city} returns this {season} for its {edition} edition.",
        "More than {c} stalls will offer dishes from around the world.",
        "This year's theme is {dish}, and several local cooks will compete for the best version.",
        "Entry is free, but visitors are asked to bring their own cups and plates.",
        "The organisers want to cut the amount of waste by half compared with last year.",
        "Live music will play on two stages from noon until late evening.",
        "A quiet area has been set up for families with young children.",
        "Public transport will run extra services on both days of the festival.",
        "Volunteers are still needed to help with setting up and cleaning.",
        "Last year, the festival attracted around {d} visitors despite the rain.",
    ],
    "school": [
        "Pupils at a primary school near {city} have built a small weather station on the roof.",
        "The project was the idea of their science teacher, {name}.",
        "Every morning, two pupils read the temperature, rainfall and wind speed.",
        "They record the numbers in a shared notebook and later on a computer.",
        "After {a} months, the class had enough data to draw their own charts.",
        "They were surprised to find that {month} was wetter than any other month.",
        "The pupils now send their readings to a national network of school weather stations.",
        "Parents say their children have started checking the sky before leaving the house.",
        "The school hopes to add a sensor for air quality next year.",
        "Other schools in the area have asked for help setting up their own stations.",
    ],
}
POOLS["object_bare"] = [
    "kettle",
    "vacuum cleaner",
    "office chair",
    "toaster",
    "washing machine",
    "desk lamp",
    "electric bike",
    "laptop",
    "headphone set",
    "coffee machine",
    "hair dryer",
]

SUMMARISE_INSTRUCTIONS = [
    "Sum up this passage in a single sentence.",
    "Summarise the text below in two or three sentences.",
    "Give me the three main points of this text as bullet points.",
    "What is the main idea of this passage? Answer briefly.",
    "Write a short headline and a one-sentence summary for this text.",
    "Summarise this for a busy reader in under thirty words.",
    "Summarise this passage for a ten-year-old.",
    "Write a TL;DR for the following text.",
    "Summarise the key facts and numbers in this passage.",
    "Summarise this text in a neutral tone, leaving out opinions.",
    "In two sentences, what happened and what happens next?",
    "Summarise the passage, then list one open question it leaves.",
    "Condense this into a short paragraph for a newsletter.",
    "Give a one-line summary and then the two most important details.",
    "Summarise this as if you were telling a friend about it.",
    "Pick out the single most important sentence and explain why it matters.",
    "Summarise the following in no more than fifty words.",
    "Turn this passage into three short bullet points.",
    "What are the arguments on each side in this text? Summarise them briefly.",
    "Summarise the passage and suggest a title for it.",
    "Write a short summary of this text for a social media post.",
    "Summarise this passage in the form of a short news brief.",
    "Who is involved and what do they want? Summarise briefly.",
    "Summarise this text, keeping all the dates and numbers.",
    "Give me a summary of this passage in plain, simple words.",
]

SUMMARISE_FRAMES = [
    "{instruction}\n\n{passage}",
    "{passage}\n\n{instruction}",
    "Read the following passage.\n\n{passage}\n\n{instruction}",
    "{instruction}\n\nText:\n{passage}",
]

QA_TEMPLATES = [
    "What is {term}?",
    "Define {term} in one sentence.",
    "What is {term}? Give one example.",
    "Explain the word '{term_bare}' briefly.",
    "What is the difference between {pair}?",
    "How can you tell the difference between {pair}?",
    "What is the capital of {country}?",
    "Which continent is {country} in, and what are its neighbouring countries?",
    "What language or languages are spoken in {country}?",
    "What currency is used in {country}?",
    "What does {abbr} stand for?",
    "Who is credited with {inventor_item}, and roughly when?",
    "Where does the {animal} live in the wild?",
    "What does the {animal} eat?",
    "How long does the {animal} usually live?",
    "In one paragraph, what is {tech}?",
    "What is {concept} in programming? Answer in two sentences.",
    "When did {history} happen?",
    "Where did {history} take place?",
    "Give a short explanation of {science}.",
    "In a sentence or two, what should everyone know about {science}?",
    "Give a one-sentence definition of {maths_concept}.",
    "What country is {city} in?",
    "Roughly how many people live in {city}?",
    "What is the main ingredient of {dish}?",
    "What is the origin of {dish}?",
    "What is the boiling point of water in Fahrenheit at sea level?",
    "Is there a simple rule of thumb for telling apart {pair}?",
    "Name one famous landmark in {city}.",
    "Why is {term} important? Keep it short.",
]
POOLS["event_bare"] = [re.sub(r"^(a|an) ", "", event) for event in _EVENTS]
POOLS["term_bare"] = [re.sub(r"^(a|an) ", "", term) for term in _TERMS]

# Multi-turn scenarios: alternating user/assistant turn templates, always ending with a user turn.
MULTI_TURN: list[list[str | tuple[str, ...]]] = [
    [
        ("I want to learn {hobby}. Any advice?", "I'd like to take up {hobby}. Where do I begin?"),
        "Start small: find a beginner guide or class, get only the basic equipment, and practise a little "
        "several times a week. Progress comes from regular practice more than from long sessions.",
        (
            "How much should I expect to spend at the start?",
            "What is the one piece of equipment worth paying for?",
            "How do I stay motivated when it gets hard?",
        ),
    ],
    [
        ("Can you help me plan a trip to {city}?", "I'm going to {city} in {season}. Can you help me plan?"),
        "Of course. How many days will you be there, and do you prefer museums, food, nature or nightlife?",
        (
            "Four days. I mostly care about food and walking around.",
            "Three days, and I love history and markets.",
            "Just a weekend, on a tight budget.",
        ),
        "Great. I'd suggest one neighbourhood per day, with a market or food hall at lunchtime and a long walk "
        "in the evening. Public transport passes usually save money for stays like this.",
        (
            "Can you turn that into a day-by-day plan?",
            "What should I avoid doing as a tourist there?",
            "Which day would you leave free in case it rains?",
        ),
    ],
    [
        ("What can I cook with {ingredient}?", "I bought too much {ingredient}. Ideas?"),
        "You could use it in {dish}, add it to a simple salad, or freeze some for later. Do you want a recipe?",
        (
            "Yes, please give me the recipe for {dish}.",
            "Which of those is quickest?",
            "I don't have an oven. Does that change anything?",
        ),
    ],
    [
        ("Explain {science}.", "What exactly is {science}?"),
        "In short, {science} is a natural process that scientists can describe with a few simple rules. "
        "Would you like an everyday example?",
        (
            "Yes, an everyday example would help.",
            "Can you explain it more simply?",
            "How did scientists first figure it out?",
        ),
    ],
    [
        "Solve {a}x + {b} = {c} for me.",
        "Subtract {b} from both sides to get {a}x = {c} - {b}, then divide both sides by {a}.",
        (
            "So what is x exactly?",
            "Can you check the answer by substituting it back?",
            "Why do we subtract first instead of dividing first?",
        ),
    ],
    [
        "Write a {lang} function that {task}.",
        "Sure. I'll write a small function with a clear name, handle the empty input case, and add a short "
        "example call at the end.",
        (
            "Please go ahead and show me the code.",
            "Can you also add a docstring or comment explaining it?",
            "Could you write it without any built-in helper functions?",
        ),
    ],
    [
        ("I need to talk to my landlord about a problem. Any tips?", "How do I raise a complaint with a landlord?"),
        "Be specific and polite, describe the problem and when it started, and put the request in writing so "
        "there is a record.",
        (
            "Could you draft a short email for a broken {object_bare}?",
            "What if they don't reply within a week?",
            "Can you make the tone firmer but still polite?",
        ),
    ],
    [
        "What's the difference between {pair}?",
        "The short answer is that they look similar but differ in a few key features. Do you want the details "
        "or a quick way to tell them apart?",
        ("A quick way to tell them apart, please.", "The details, please.", "Can you put it in a small table?"),
    ],
    [
        (
            "My friend {name} has a birthday soon and loves {hobby}. Gift ideas?",
            "I need a gift for {name}, who is into {hobby}.",
        ),
        "A few options: a good beginner book about {hobby}, a small piece of quality equipment, or a class "
        "you could take together.",
        (
            "The class idea sounds good. How do I find one?",
            "Can you suggest something under twenty euros?",
            "Write a short card message to go with the gift.",
        ),
    ],
    [
        "I have {a} {shop_item} at {price} each. What's the total?",
        "Multiply the number of items by the price: {a} times {price}.",
        (
            "Right, and what is the result?",
            "And if I get a {pct}% discount on the total?",
            "How much change would I get from a hundred?",
        ),
    ],
    [
        ("How should I prepare for {event}?", "I'm organising {event}. Where do I start?"),
        "Decide on a date, a budget and a rough guest list first; everything else, from food to decorations, "
        "follows from those three.",
        (
            "We have a small budget. How can we save money?",
            "Can you make a checklist for the week before?",
            "How many people should help me run it?",
        ),
        "Keep it simple: share tasks among friends, choose one affordable food option, and borrow equipment "
        "instead of buying it.",
        (
            "Thanks. What should I do on the day itself?",
            "Could you write the invitation text?",
            "What is the most common thing people forget?",
        ),
    ],
    [
        "Tell me about {history}.",
        "It was a turning point that changed trade, communication and everyday life for many people. Which part "
        "interests you most: the causes, the people involved, or the consequences?",
        ("The consequences, please.", "Who were the main people involved?", "What caused it in the first place?"),
    ],
    [
        "Rewrite this more politely: '{rude}'",
        "Here is a politer version: 'Would you mind helping me with this when you have a moment? Thank you.'",
        (
            "Can you make it even more formal?",
            "That's too formal. Make it friendly but polite.",
            "Now translate it into French.",
        ),
    ],
    [
        ("What is {concept} in programming?", "Can you explain {concept}?"),
        "It is a common idea in software that helps keep programs correct and easier to reason about. "
        "Shall I show a tiny example?",
        ("Yes, in {script}.", "Yes, and compare it with {concept2}.", "When would I not want to use it?"),
    ],
    [
        ("I keep failing to {goal}.", "How do I {goal}? I've tried before and failed."),
        "That's very common. The trick is to make the first step tiny and to attach the new habit to "
        "something you already do every day.",
        ("Can you give me a concrete example?", "What if I miss a day?", "How long until it feels automatic?"),
    ],
    [
        "Give me {n} facts about the {animal}.",
        "Sure, here are a few: it has some unusual adaptations, a distinctive way of finding food, and an "
        "interesting social life. Want them in more detail?",
        (
            "Yes, explain the adaptations.",
            "Which of those is the most surprising?",
            "Tell me which animals are its closest relatives.",
        ),
    ],
    [
        ("Is {choice} a good idea?", "I'm thinking about {choice}. Thoughts?"),
        "It depends on your situation. It has real advantages but also some costs. What matters most to you: "
        "money, time or comfort?",
        ("Mostly money.", "Mostly time.", "Comfort, honestly."),
        "Then it's worth comparing the long-term costs, not just the first month, and talking to someone who "
        "has already done it.",
        (
            "Can you list the questions I should ask them?",
            "What would you decide in my place?",
            "Summarise the pros and cons in a few bullet points.",
        ),
    ],
    [
        "How do I convert {unit_pair}?",
        "You multiply by a fixed conversion factor. Do you want the factor and a worked example?",
        (
            "Yes, with {km} as the example number.",
            "Just the factor, please.",
            "Is there an easy way to estimate it in my head?",
        ),
    ],
    [
        "Summarise this in one line: {short_text}",
        "A short summary: a brief update with one main point and a small request.",
        ("Can you make it more specific?", "Now write a title for it.", "Turn it into a reply I could send."),
    ],
    [
        ("What should I see in {country}?", "I'm going to {country} for two weeks. Must-sees?"),
        "It depends on whether you like cities or nature, but most visitors combine the capital with a few days "
        "in a smaller town and one natural area.",
        ("I prefer nature.", "I prefer cities.", "I'd like a bit of both, travelling by train."),
    ],
    [
        "Explain {maths_concept} to me.",
        "Sure. I'll start with the idea in words, then show one small example with numbers.",
        ("Go ahead with the example.", "Can you give me a practice problem?", "Where is this used in real life?"),
        "Here is a practice problem: try it yourself and tell me your answer, and I'll check it.",
        ("I got {a}. Is that right?", "I'm stuck. Can you give me a hint?", "Can you show me the full solution?"),
    ],
    [
        "What's a good name for my {place_kind} in {city}?",
        "Some ideas: a name that mentions the neighbourhood, a playful pun, or the founder's first name. "
        "What feeling should the name give?",
        ("Warm and cosy.", "Modern and simple.", "Fun and a bit quirky."),
    ],
    [
        ("Why does my {object_bare} keep breaking?", "My {object_bare} stopped working again. Why?"),
        "Common causes are wear on a moving part, a loose connection, or using it beyond what it was designed "
        "for. When did you last service or clean it?",
        ("Never, to be honest.", "About a year ago.", "Is it worth repairing or should I replace it?"),
    ],
    [
        "Write a short story opening about a {animal} in {city}.",
        "Here's an opening: 'Nobody in {city} expected to see a {animal} on the tram that morning, least of all "
        "the driver.'",
        ("Continue the story for another paragraph.", "Make it funnier.", "Give it a surprising ending."),
    ],
    [
        "Quiz me on {science}.",
        "Question one: in a single sentence, what is {science}?",
        (
            "I'm not sure. What's the answer?",
            "It's a natural process. Next question?",
            "Can you make the questions easier?",
        ),
    ],
]
POOLS["rude"] = [
    "Fix this now.",
    "Give me the report.",
    "Move your car.",
    "Stop talking during the film.",
    "Send me the files.",
    "Answer my email.",
    "Clean the kitchen.",
    "Turn that music down.",
    "Pay me back.",
    "Be on time tomorrow.",
]
POOLS["short_text"] = [
    "The meeting is moved to {day}; please bring your notes.",
    "Our {place_kind} will be closed on {day} for repairs.",
    "{name} will collect the keys on {day} morning.",
    "The train to {city} is delayed by {minutes} minutes.",
    "Dinner is at seven on {day}; bring a dessert if you can.",
]
POOLS["science_cap"] = [topic[:1].upper() + topic[1:] for topic in _SCIENCE]

# --------------------------------------------------------------------------------------------------------------------


# Pools whose entries are templates themselves; every other pool (code snippets especially) is inserted verbatim.
_TEMPLATED_POOLS = frozenset({"short_text"})


class _Slots(dict[str, str]):
    """Draws each slot once per prompt, so a repeated ``{name}`` names the same person throughout."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self._rng = rng

    def __missing__(self, key: str) -> str:
        base = key.rstrip("0123456789")
        pool = POOLS[base]
        taken = {v for k, v in self.items() if k.rstrip("0123456789") == base}
        # Numbered slots must differ from their siblings ("{name} gives ... to {name2}").
        for _ in range(50):
            value = pool(self._rng) if callable(pool) else self._rng.choice(pool)
            if value not in taken:
                break
        # Pool entries may themselves hold slots (short_text), filled from the same draws.
        if base in _TEMPLATED_POOLS:
            value = value.format_map(self)
        self[key] = value
        return value


def _fill(template: str, slots: _Slots) -> str:
    return template.format_map(slots)


def _pick(turn: str | tuple[str, ...], rng: random.Random) -> str:
    return rng.choice(turn) if isinstance(turn, tuple) else turn


def _user(text: str) -> list[Message]:
    return [{"role": "user", "content": text}]


def _chat(rng: random.Random) -> list[Message]:
    return _user(_fill(rng.choice(CHAT_TEMPLATES), _Slots(rng)))


def _code(rng: random.Random) -> list[Message]:
    return _user(_fill(rng.choice(CODE_TEMPLATES), _Slots(rng)))


def _maths(rng: random.Random) -> list[Message]:
    return _user(_fill(rng.choice(MATHS_TEMPLATES), _Slots(rng)))


def _lists(rng: random.Random) -> list[Message]:
    return _user(_fill(rng.choice(LISTS_TEMPLATES), _Slots(rng)))


def _rewrite(rng: random.Random) -> list[Message]:
    slots = _Slots(rng)
    text = _fill(rng.choice(REWRITE_TEXTS), slots)
    instruction = _fill(rng.choice(REWRITE_INSTRUCTIONS), slots)
    return _user(rng.choice(REWRITE_FRAMES).format(instruction=instruction, text=text))


def _passage(rng: random.Random, slots: _Slots) -> str:
    sentences = PASSAGES[rng.choice(sorted(PASSAGES))]
    while True:
        # The opening sentence introduces the subject the rest refer back to, so it is always kept.
        keep = sorted(rng.sample(range(1, len(sentences)), rng.randint(4, len(sentences) - 1)))
        passage = " ".join(_fill(sentences[i], slots) for i in [0, *keep])
        if 60 <= len(passage.split()) <= 200:
            return passage


def _summarise(rng: random.Random) -> list[Message]:
    slots = _Slots(rng)
    passage = _passage(rng, slots)
    instruction = rng.choice(SUMMARISE_INSTRUCTIONS)
    return _user(rng.choice(SUMMARISE_FRAMES).format(instruction=instruction, passage=passage))


def _qa(rng: random.Random) -> list[Message]:
    return _user(_fill(rng.choice(QA_TEMPLATES), _Slots(rng)))


def _multi_turn(rng: random.Random) -> list[Message]:
    scenario = rng.choice(MULTI_TURN)
    # A three-user-turn scenario is sometimes cut after its second user turn, for more two-turn variety.
    if len(scenario) == 5 and rng.random() < 0.3:
        scenario = scenario[:3]
    slots = _Slots(rng)
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": _fill(_pick(turn, rng), slots)} for i, turn in enumerate(scenario)]


# Long contexts: a document of many parts (a report of passages, a source file of snippets) with a task about one
# part or the whole, or a conversation that goes on after such a document. Serving meets prompts of thousands of
# tokens (documents, logs, long chats); a head trained on short prompts alone drafts badly at those positions.
LONG_REPORT_TITLES = ["Team notes", "Field report", "Reading notes", "Briefing pack", "Study guide", "Weekly digest"]
LONG_REPORT_TASKS = [
    "Summarise part {part} in two sentences.",
    "What is part {part} about? Answer briefly.",
    "Give each part a short title.",
    "List the three most important points of the whole document.",
    "Rewrite part {part} for a ten-year-old.",
    "Which part mentions the most people, and who are they?",
    "Write a one-paragraph summary of the document.",
    "Turn part {part} into a bulleted list.",
]
LONG_CODE_TASKS = [
    "Explain what the code in part {part} does.",
    "Write a short docstring or comment for each part.",
    "Which parts are not Python? Say what language each of them is.",
    "Find the bugs in these files and show the fixes.",
    "Write two unit tests for the code in part {part}.",
    "Rewrite part {part} so it is easier to read.",
    "Give a one-line summary of every part.",
]
_LONG_CODE_POOLS = {
    "py_snippet": "python",
    "py_buggy": "python",
    "js_snippet": "javascript",
    "sql_snippet": "sql",
    "bash_snippet": "bash",
}


def _long_report(rng: random.Random) -> tuple[str, int]:
    parts = [_passage(rng, _Slots(rng)) for _ in range(rng.randint(6, 14))]
    body = "\n\n".join(f"Part {i}.\n{passage}" for i, passage in enumerate(parts, 1))
    return f"{rng.choice(LONG_REPORT_TITLES)}\n\n{body}", len(parts)


def _long_code(rng: random.Random) -> tuple[str, int]:
    pools = sorted(_LONG_CODE_POOLS)
    parts = []
    for _ in range(rng.randint(20, 40)):
        pool = rng.choice(pools)
        parts.append(f"```{_LONG_CODE_POOLS[pool]}\n{rng.choice(POOLS[pool])}\n```")
    return "\n\n".join(f"Part {i}:\n{part}" for i, part in enumerate(parts, 1)), len(parts)


def _long_context(rng: random.Random) -> list[Message]:
    # two reports for every source file: prose is what most long prompts (documents, notes, mail) hold
    make, tasks = rng.choice(
        [(_long_report, LONG_REPORT_TASKS), (_long_report, LONG_REPORT_TASKS), (_long_code, LONG_CODE_TASKS)]
    )
    document, parts = make(rng)
    if rng.random() < 0.7:
        task = rng.choice(tasks).format(part=rng.randint(1, parts))
        return _user(rng.choice(["{document}\n\n{task}", "{task}\n\n{document}"]).format(document=document, task=task))
    # A conversation that goes on after the document: turns of other kinds, then a question of its own.
    messages = [
        {"role": "user", "content": f"{document}\n\nPlease read this; I will ask about it later."},
        {"role": "assistant", "content": rng.choice(["Done. What would you like to know?", "I have read it."])},
    ]
    last = rng.choice([_chat, _qa, _lists, _multi_turn, _maths])(rng)
    return [*messages, *last]


GENERATORS: dict[str, Callable[[random.Random], list[Message]]] = {
    "chat": _chat,
    "code": _code,
    "maths": _maths,
    "lists": _lists,
    "rewrite": _rewrite,
    "summarise": _summarise,
    "qa": _qa,
    "multi-turn": _multi_turn,
    LONG_CONTEXT: _long_context,
}


def normalise(text: str) -> str:
    """Case- and whitespace-insensitive form used for every equality check against other prompts."""
    return " ".join(text.lower().split())


def sentences(text: str) -> list[str]:
    """Normalised sentences of ``text``, split on end punctuation and line breaks."""
    parts = re.split(r"(?<=[.!?])\s+|\n+", text)
    return [normalise(p) for p in parts if p.strip()]


def user_text(messages: Sequence[Message]) -> str:
    """The key a row is deduplicated on: its user turns, in order."""
    return "\n".join(m["content"] for m in messages if m["role"] == "user")


def load_bench_prompts(bench_dir: Path = BENCH_DIR) -> list[str]:
    """The ``prompt`` field of every row of the benchmark prompt files."""
    prompts = []
    for name in BENCH_FILES:
        with (bench_dir / name).open(encoding="utf-8") as f:
            prompts.extend(json.loads(line)["prompt"] for line in f if line.strip())
    return prompts


def generate_rows(bench_prompts: Sequence[str] | None = None) -> list[dict[str, object]]:
    """All rows of the prompt set, in file order."""
    if bench_prompts is None:
        bench_prompts = load_bench_prompts()
    bench_texts = {normalise(p) for p in bench_prompts}
    # Sentences under three words ("Thanks.") are too generic to count as reuse.
    bench_sentences = {s for p in bench_prompts for s in sentences(p) if len(s.split()) >= 3}
    seen: set[str] = set()
    rows: list[dict[str, object]] = []
    for category in CATEGORIES:
        # One RNG per category, so editing one category's templates leaves the others' rows unchanged.
        rng = random.Random(f"{SEED}:{category}")
        chosen: list[list[Message]] = []
        attempts = 0
        count = PER_CATEGORY_OVERRIDE.get(category, PER_CATEGORY)
        words = LONG_CONTEXT_WORDS if category == LONG_CONTEXT else (0, MAX_USER_WORDS)
        while len(chosen) < count:
            attempts += 1
            if attempts > 200 * count:
                raise RuntimeError(f"{category}: only {len(chosen)} distinct prompts after {attempts} draws")
            messages = GENERATORS[category](rng)
            key = normalise(user_text(messages))
            if key in seen or not words[0] <= len(key.split()) <= words[1]:
                continue
            texts = [m["content"] for m in messages]
            if key in bench_texts or any(normalise(t) in bench_texts for t in texts):
                continue
            if any(s in bench_sentences for t in texts for s in sentences(t)):
                continue
            seen.add(key)
            chosen.append(messages)
        heldout = set(random.Random(f"{SEED}:heldout:{category}").sample(range(count), HELDOUT_PER_CATEGORY))
        for i, messages in enumerate(chosen):
            rows.append(
                {
                    "id": f"{category}-{i + 1:04d}",
                    "category": category,
                    "split": "heldout" if i in heldout else "train",
                    "messages": messages,
                }
            )
    return rows


def render_lines(bench_prompts: Sequence[str] | None = None) -> list[str]:
    """The lines of ``prompts.jsonl``, each ending in a newline."""
    return [json.dumps(row, ensure_ascii=False) + "\n" for row in generate_rows(bench_prompts)]


def main() -> None:
    lines = render_lines()
    with OUTPUT_PATH.open("w", encoding="utf-8", newline="\n") as f:
        f.writelines(lines)
    print(f"wrote {len(lines)} rows to {OUTPUT_PATH}")


if __name__ == "__main__":
    main()
